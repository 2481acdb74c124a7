"""StageRunner under stress: rollback storms on mock stages with random delays on every link.

Mock drafters agree with the stage below at 0, 0.5, 0.9 and 1; every message (drafts, verdicts,
commits, opens, closes) is delayed at random, so messages on different links overtake each other and
verdicts cross drafts in flight. The output must still equal the mock target alone, token for
token, for greedy and coupled sampling, with many requests at once; the mock's KV length invariant
(checked on every forward) must never fire, which the last tests show it would.
"""

from __future__ import annotations

import random

import pytest

import pipespec.engine.runner as runner_module
from pipespec import GenerationError, LocalPipeline, load_config
from pipespec.engine.stage import KVLengthError
from pipespec.engine.step import compute_batch as batch
from pipespec.protocol.links import DelayLink
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.stages.build_context import BuildContext


def mock_config(agreements, lookahead=4, latencies=None, predraft=0, runner_up=0.0, max_batch=1):
    latencies = latencies or [0.0] * len(agreements)
    return load_config(
        {
            "stages": [
                {
                    "name": f"m{i}",
                    "kind": "mock",
                    "agreement": a,
                    "latency_ms": lat,
                    "max_lookahead": lookahead,
                    "vocab_size": 50,
                    "predraft": predraft,
                    "runner_up": runner_up if i < len(agreements) - 1 else 0.0,
                    "max_batch": max_batch,
                }
                for i, (a, lat) in enumerate(zip(agreements, latencies))
            ]
        }
    )


@pytest.fixture(scope="module")
def target_alone():
    with LocalPipeline(mock_config([1.0])) as p:
        yield p


def requests(n=12):
    return [
        dict(prompt_token_ids=[i % 7 + 1, i % 5 + 2, 3], max_new_tokens=40, temperature=0.0 if i % 2 else 1.0, seed=i)
        for i in range(n)
    ]


@pytest.mark.parametrize("agreement", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_random_delays_keep_output_exact(agreement, k, target_alone):
    rng = random.Random(f"{agreement}-{k}")
    config = mock_config([agreement] * (k - 1) + [1.0], lookahead=rng.randint(1, 6))
    with LocalPipeline(config, link_factory=lambda peer: DelayLink(peer, 0.002, rng)) as p:
        futures = [(p.submit(**r), target_alone.submit(**r)) for r in requests()]
        results = [(f.result(timeout=60), ref.result(timeout=60)) for f, ref in futures]
        for runner in p.runners:  # every stage has closed every request (its statistics are in): none left behind
            assert not runner.requests and not runner.unprefilled, runner.name
    for got, want in results:
        assert got.token_ids == want.token_ids
        assert got.finish_reason == "length"
    rollbacks = sum(s.rollbacks for got, _ in results for s in got.stats.stages)
    accepted = sum(pair.num_accepted_tokens for got, _ in results for pair in got.stats.pairs)
    if agreement < 1.0:
        assert rollbacks > 0, "the storm produced no rollback: the test exercises nothing"
    if agreement > 0.0:
        assert accepted > 0


@pytest.mark.parametrize("agreement", [0.5, 0.9])
@pytest.mark.parametrize("k", [2, 3])
def test_batched_forwards_under_random_delays_keep_output_exact(agreement, k, target_alone, monkeypatch):
    """Every stage's forward carries every request ready at it (up to 16; the mock's batched cost model): each
    request's answer is still the target alone's, greedy and seeded, and the batches did carry several; what a
    forward produced for several requests travelled to each peer as one delivery."""
    rng = random.Random(f"batched-{agreement}-{k}")
    deliveries: list[set[str]] = []  # the requests each delivery of several messages was about

    class Counted(DelayLink):
        def send_all(self, messages):
            deliveries.append({m.request_id for m in messages})
            return super().send_all(messages)

    config = mock_config([agreement] * (k - 1) + [1.0], lookahead=rng.randint(2, 6), latencies=[0.3] * k, max_batch=4)
    batches = []
    monkeypatch.setattr(
        runner_module, "compute_batch", lambda stage, work, *a: batches.append(len(work)) or batch(stage, work, *a)
    )
    with LocalPipeline(config, link_factory=lambda peer: Counted(peer, 0.002, rng)) as p:
        p.start_trace()
        futures = [(p.submit(**r), target_alone.submit(**r)) for r in requests()]
        results = [(f.result(timeout=60), ref.result(timeout=60)) for f, ref in futures]
        traced = [runner.trace.steps for runner in p.runners]
        p.stop_trace()
        for runner in p.runners:
            assert not runner.requests and not runner.unprefilled, runner.name
    for got, want in results:
        assert got.token_ids == want.token_ids and got.finish_reason == "length"
    carried = [max(s.requests for s in steps) for steps in traced]
    assert carried == [4] * k, carried  # every stage's forwards carried several requests at times, at most 4
    assert batches and max(batches) == 4  # each as one forward of the stage (compute_batch: the mock's one_forward)
    assert all(s.requests == 1 for steps in traced for s in steps if s.kind == "prefill")  # prefills one at a time
    assert max(len(about) for about in deliveries) > 1  # a batch's drafts, verdicts or commits went together
    assert sum(pair.num_accepted_tokens for got, _ in results for pair in got.stats.pairs) > 0


@pytest.mark.parametrize("agreement", [0.5, 0.9])
@pytest.mark.parametrize("k", [2, 3])
def test_pre_drafting_under_random_delays_keeps_output_exact(agreement, k, target_alone):
    """Every drafter pre-drafts branches (pipespec.engine.outcome_cache) and serves verdicts from them, a middle
    stage handing its drafter the branch it took in its Verdict: every answer still equals the target alone's
    (the target's option is inert). Mock stages run tree forwards: branches grow beside every step (branch
    correctness, hits included: tests/test_outcome_cache.py)."""
    rng = random.Random(f"predraft-{agreement}-{k}")
    latencies = [0.2, 1.0, 3.0][-k:]
    agreements = [agreement] * (k - 1) + [1.0]
    config = mock_config(agreements, lookahead=rng.randint(2, 6), latencies=latencies, predraft=3, runner_up=0.5)
    with LocalPipeline(config, link_factory=lambda peer: DelayLink(peer, 0.002, rng)) as p:
        futures = [(p.submit(**r), target_alone.submit(**r)) for r in requests()]
        results = [(f.result(timeout=60), ref.result(timeout=60)) for f, ref in futures]
        for runner in p.runners:  # every stage has closed every request (its statistics are in): none left behind
            assert not runner.requests and not runner.unprefilled, runner.name
    for got, want in results:
        assert got.token_ids == want.token_ids
    for i in range(k - 1):
        assert sum(got.stats.stages[i].predraft_forwards for got, _ in results) > 0, f"m{i} never pre-drafted"
    assert all(got.stats.stages[-1].predraft_forwards == 0 for got, _ in results)
    if agreement == 0.5:  # rejections enough that the stage next to the target served branches (with k = 3, the
        # middle stage, whose drafter heard of them in its Verdicts)
        assert sum(got.stats.stages[-2].predraft_tokens for got, _ in results) > 0


def test_emulated_latency_pipeline_speculates(target_alone):
    """With a slow target and a fast, agreeing drafter, most tokens come from accepted drafts."""
    with LocalPipeline(mock_config([0.9, 1.0], lookahead=6, latencies=[0.5, 6.0])) as p:
        got = p.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=60)
    assert got.token_ids == target_alone.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=60).token_ids
    (pair,) = got.stats.pairs
    assert pair.mean_acceptance_length > 2.0, pair.as_dict()
    assert got.stats.stages[-1].forwards < 40  # target forwards for 60 tokens, prefill included


def test_every_forward_counts_its_seconds_the_prefill_included():
    """A stage's compute seconds hold each of its forwards, its prefill too (a mock forward lasts at least its
    latency): a drafter timed on its prefill alone once had a latency of 0."""
    with LocalPipeline(mock_config([0.9, 1.0], latencies=[10.0, 10.0])) as p:
        got = [p.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=n) for n in (8, 1)]
    for stage in (s for g in got for s in g.stats.stages):
        assert stage.compute_s >= stage.forwards * 0.010, stage.as_dict()
    assert all(s.forwards >= 1 for s in got[0].stats.stages)


def test_kv_invariant_fires_on_a_bad_keep():
    from pipespec.stages.mock import MockStage

    stage = MockStage(mock_config([1.0]).stages[0])
    session = stage.open(RequestSpec("r", (1, 2, 3), SamplingParams(), 8))
    session.forward(2, [3, 4])
    with pytest.raises(KVLengthError, match="keep 9"):
        session.forward(9, [5])


def test_a_stage_failure_ends_only_its_request(target_alone):
    """A stage that raises for one request fails that request; the others finish exactly."""
    from pipespec.stages.mock import MockStage

    class Faulty(MockStage):
        def open(self, request):
            session = super().open(request)
            if request.prompt_token_ids[0] == 13:
                session.forward = lambda keep, tokens: (_ for _ in ()).throw(RuntimeError("boom"))
            return session

    config = mock_config([0.7, 1.0])
    stages = [Faulty(config.stages[0], BuildContext(config.stages)), MockStage(config.stages[1])]
    with LocalPipeline(config, stages=stages) as p:
        good = [p.submit(**r) for r in requests(6)]
        bad = p.submit(prompt_token_ids=[13, 2, 3], max_new_tokens=40)
        with pytest.raises(GenerationError, match="m0.*boom"):
            bad.result(timeout=30)
        for fut, r in zip(good, requests(6)):
            assert fut.result(timeout=30).token_ids == target_alone.generate(**r).token_ids
