"""Prometheus metrics (pipespec.serving.metrics): what one request records as it streams, registries
that do not clash, and, against a served random-weight chain (tiny -> mid -> target), `/metrics`
parsed with prometheus_client's parser before and after requests: the counters grow by the sums of the
requests' usage blocks, and the per-position counts sum to the accepted tokens.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipespec.config import StageSpec
from pipespec.protocol.stats import PairStats, RequestStats, StageStats
from pipespec.requests.outputs import Delta
from pipespec.serving.metrics import Metrics
from pipespec.stages.causal_lm import CausalLMStage
from tests.fixtures.exactness import text_pipeline
from tests.fixtures.openai_http import client, increase, scrape

PAIR = (("drafter", "a"), ("verifier", "b"))


def at(position: int) -> tuple[tuple[str, str], ...]:
    """The labels of PAIR's per-position sample, sorted as `samples` keeps them."""
    return tuple(sorted((*PAIR, ("position", str(position)))))


def samples(metrics: Metrics) -> dict:
    text = metrics.exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def finished(reason: str, pairs: list[PairStats]) -> Delta:
    return Delta("", (), reason, RequestStats(5, 3, 0.1, 0.2, pairs, []))


def test_a_request_is_recorded_as_it_streams():
    metrics = Metrics(pairs=[("a", "b")])
    assert samples(metrics)[("pipespec:spec_decode_num_drafts_total", PAIR)] == 0  # shown before any request
    record = metrics.request(prompt_tokens=5, arrived=time.perf_counter())
    assert samples(metrics)[("pipespec:num_requests_waiting", ())] == 1
    assert samples(metrics)[("pipespec:num_requests_running", ())] == 0
    record.observe(Delta("a", (1, 2)))
    assert samples(metrics)[("pipespec:num_requests_waiting", ())] == 0
    assert samples(metrics)[("pipespec:num_requests_running", ())] == 1
    record.observe(Delta("b", (3,)))
    pair = PairStats("a", "b")
    pair.record(drafted=3, accepted=2, nodes=5)  # a tree: 3 drafts and 2 siblings
    pair.record(drafted=2, accepted=0)
    record.observe(finished("stop", [pair]))
    record.close()
    got = samples(metrics)
    assert got[("pipespec:spec_decode_num_drafts_total", PAIR)] == 2
    assert got[("pipespec:spec_decode_num_draft_tokens_total", PAIR)] == 5
    assert got[("pipespec:spec_decode_num_accepted_tokens_total", PAIR)] == 2
    assert got[("pipespec:spec_decode_num_nodes_total", PAIR)] == 7
    assert got[("pipespec:spec_decode_num_accepted_tokens_per_pos_total", at(0))] == 1
    assert got[("pipespec:spec_decode_num_accepted_tokens_per_pos_total", at(1))] == 1
    assert got[("pipespec:request_success_total", (("finished_reason", "stop"),))] == 1
    assert got[("pipespec:prompt_tokens_total", ())] == 5
    assert got[("pipespec:generation_tokens_total", ())] == 3
    assert got[("pipespec:time_to_first_token_seconds_count", ())] == 1
    assert got[("pipespec:inter_token_latency_seconds_count", ())] == 1
    assert got[("pipespec:e2e_request_latency_seconds_count", ())] == 1
    assert got[("pipespec:num_requests_running", ())] == 0 and got[("pipespec:num_requests_waiting", ())] == 0


def test_pre_drafting_and_relaying_are_counted_per_stage():
    metrics = Metrics()
    tiny = StageStats("tiny", predraft_hits=2, predraft_misses=3, predraft_tokens=5, predraft_forwards=9, relayed_drafts=4)
    record = metrics.request(prompt_tokens=5, arrived=time.perf_counter())
    target = StageStats("target", kv_use=0.25)
    record.observe(Delta("", (), "length", RequestStats(5, 3, 0.1, 0.2, [], [tiny, target])))
    got = samples(metrics)
    stage = (("stage", "tiny"),)
    assert got[("pipespec:kv_cache_usage_perc", (("stage", "target"),))] == 0.25  # as the stage last reported it
    assert got[("pipespec:predraft_hits_total", stage)] == 2
    assert got[("pipespec:predraft_misses_total", stage)] == 3
    assert got[("pipespec:predraft_tokens_total", stage)] == 5
    assert got[("pipespec:predraft_forwards_total", stage)] == 9
    assert got[("pipespec:relayed_drafts_total", stage)] == 4
    assert ("pipespec:predraft_hits_total", (("stage", "target"),)) not in got  # a stage that did not pre-draft


def test_a_request_left_before_its_finish_counts_as_aborted():
    metrics = Metrics()
    record = metrics.request(prompt_tokens=2, arrived=time.perf_counter())
    record.observe(Delta("a", (1,)))
    record.close()
    record.close()  # once only
    metrics.request(prompt_tokens=2, arrived=time.perf_counter()).close()  # left before its first token
    got = samples(metrics)
    assert got[("pipespec:request_success_total", (("finished_reason", "abort"),))] == 2
    assert got[("pipespec:num_requests_running", ())] == 0 and got[("pipespec:num_requests_waiting", ())] == 0
    assert got[("pipespec:e2e_request_latency_seconds_count", ())] == 2


def test_each_metrics_has_its_own_registry():
    one, two = Metrics(pairs=[("a", "b")]), Metrics(pairs=[("a", "b")])  # same names, no clash
    one.request(prompt_tokens=7, arrived=time.perf_counter()).close()
    assert samples(one)[("pipespec:prompt_tokens_total", ())] == 7
    assert samples(two)[("pipespec:prompt_tokens_total", ())] == 0


# ---- /metrics of a served chain -------------------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the red circle"}]
REQUESTS = [  # (create keywords, whether streamed)
    (dict(max_tokens=16), False),
    (dict(max_tokens=16, temperature=0.8, seed=4), True),
    (dict(max_tokens=24, temperature=1.0, seed=9, n=2), False),
    (dict(max_tokens=20), True),
]


@pytest.fixture(scope="module")
def served(family):
    names = ["tiny", "mid", "target"]
    loaded = {name: CausalLMStage(StageSpec(name, "causal_lm", family[name], dtype="float32")) for name in names}
    with text_pipeline(family, loaded, names) as pipe:
        yield pipe, pipe.serve_http()


def test_the_counters_grow_by_the_sums_of_the_usage_blocks(served):
    pipe, port = served
    openai = client(port)
    before = scrape(port)
    usages, choices = [], 0
    for ask, stream in REQUESTS:
        answer = openai.chat.completions.create(
            model=pipe.serving.model,
            messages=CONVERSATION,
            stream=stream,
            **ask,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        usages.append(list(answer)[-1].usage if stream else answer.usage)
        choices += ask.get("n", 1)
    after = scrape(port)

    want: dict = defaultdict(lambda: defaultdict(float))  # pair -> field -> sum of the usage blocks
    want_positions: dict = defaultdict(lambda: defaultdict(float))  # pair -> position -> sum
    for usage in usages:
        for block in usage.speculative_decoding:
            pair = (("drafter", block["drafter"]), ("verifier", block["verifier"]))
            for field in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
                want[pair][field] += block[field]
            for position, count in enumerate(block["num_accepted_tokens_per_pos"]):
                want_positions[pair][position] += count
    assert sorted(want) == [(("drafter", "mid"), ("verifier", "target")), (("drafter", "tiny"), ("verifier", "mid"))]
    drafts = increase(before, after, "pipespec:spec_decode_num_drafts_total")
    draft_tokens = increase(before, after, "pipespec:spec_decode_num_draft_tokens_total")
    accepted = increase(before, after, "pipespec:spec_decode_num_accepted_tokens_total")
    per_position = increase(before, after, "pipespec:spec_decode_num_accepted_tokens_per_pos_total")
    for pair, sums in want.items():
        assert drafts[pair] == sums["num_spec_steps"]
        assert draft_tokens[pair] == sums["num_draft_tokens"]
        assert accepted[pair] == sums["num_accepted_draft_tokens"]
        positions = {int(dict(labels)["position"]): n for labels, n in per_position.items() if set(pair) < set(labels)}
        assert {p: n for p, n in positions.items() if n} == {p: n for p, n in want_positions[pair].items() if n}
        assert sum(positions.values()) == accepted[pair]
    assert sum(accepted.values()) > 0, "nothing was accepted: the test would not exercise the counters"

    reasons = increase(before, after, "pipespec:request_success_total")
    assert sum(reasons.values()) == choices and set(reasons) <= {(("finished_reason", "stop"),), (("finished_reason", "length"),)}
    assert increase(before, after, "pipespec:generation_tokens_total") == {(): sum(u.completion_tokens for u in usages)}
    prompts = sum(u.prompt_tokens * ask.get("n", 1) for u, (ask, _) in zip(usages, REQUESTS))  # usage counts a prompt once
    assert increase(before, after, "pipespec:prompt_tokens_total") == {(): prompts}
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert increase(before, after, f"pipespec:{histogram}_count") == {(): choices}
    assert after[("pipespec:num_requests_running", ())] == 0
