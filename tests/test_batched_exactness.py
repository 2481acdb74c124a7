"""Batched steps change no answer: every forward carries every ready request (`max_batch`), bitwise as alone.

The reference is the target alone answering one request at a time. The same target with 16 requests in
flight, and every pipeline in front of it (text chains of the toy Llamas; a DREAM chain with images on
LLaVA and Qwen2-VL, whose rotary positions after an image are each request's own), answer exactly the
same, token for token, greedy and seeded; and their forwards did carry several requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pipespec import LocalPipeline, load_config
from pipespec.config import StageSpec
from pipespec.stages.causal_lm import CausalLMStage
from tests.fixtures.exactness import image_requests, run_all, sampling_cases
from tests.fixtures.toy_models import prompt_ids
from tests.test_dream import world  # noqa: F401  (a fixture: a VLM family with a DREAM drafter)

MAX_BATCH = 8
NEW_TOKENS = 16


def _config(
    paths: dict[str, str],
    names: Sequence[str],
    kinds: dict[str, str] | None = None,
    relay_above: int | None = None,
    tree: dict | None = None,
):
    """`relay_above`: the middle stage's, where the chain has one; `tree`: the stage's right before the target."""
    stages = [
        {
            "name": n, "kind": (kinds or {}).get(n, "causal_lm"), "model": paths[n], "max_lookahead": 4,
            "dtype": "float32", "max_batch": MAX_BATCH,
        }
        for n in names
    ]  # fmt: skip
    if relay_above is not None:
        stages[1]["relay_above"] = relay_above
    if tree is not None:
        stages[-2]["tree"] = tree
    return load_config({"stages": stages})


class Widths:
    """Spies on stages' `forward_batch`: the most requests one forward carried, and the tree nodes past a line fed."""

    def __init__(self, stages):
        self.most = 0
        self.siblings = 0
        for stage in stages:
            run = stage.forward_batch
            stage.forward_batch = lambda feeds, run=run: self._note(feeds) or run(feeds)

    def _note(self, feeds) -> None:
        self.most = max(self.most, len(feeds))
        self.siblings += sum(len(f.nodes.tree) - len(set(f.nodes.tree.parents)) for f in feeds if f.nodes)  # nodes off the line


@pytest.fixture(scope="module")
def batching(family):
    return {
        name: CausalLMStage(StageSpec(name, "causal_lm", path, dtype="float32", max_batch=MAX_BATCH))
        for name, path in family.items()
    }


@pytest.fixture(scope="module")
def prompts(family):
    return prompt_ids(family["target"], 16, length=12, seed=11)


def _kwargs(params) -> dict:
    return dict(
        max_new_tokens=NEW_TOKENS, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed
    )


@pytest.fixture(scope="module")
def one_at_a_time(family, batching, prompts):
    """The target alone, one request in flight at a time: per sampling case, each prompt's answer."""
    with LocalPipeline(_config(family, ["target"]), stages=[batching["target"]]) as p:
        return [[p.generate(prompt_token_ids=q, **_kwargs(params)).token_ids for q in prompts] for params in sampling_cases()]


TREE = {"budget": 6, "branching": 3}


@pytest.mark.parametrize(
    "names, relay_above, tree",
    [
        (["target"], None, None),
        (["tiny", "target"], None, None),
        (["tiny", "mid", "target"], None, None),
        (["tiny", "mid", "target"], 4, None),
        (["tiny", "target"], None, TREE),
        (["tiny", "mid", "target"], None, TREE),
    ],
    # relay: mid passes tiny's drafts on unchecked while over 4 are open; tree: the stage before the target offers
    # siblings, the target checks the best of them beside the drafts in one tree forward
    ids=["alone", "k2", "k3", "k3-relay", "k2-tree", "k3-tree"],
)
def test_sixteen_in_flight_answer_as_the_target_alone_one_at_a_time(
    names, relay_above, tree, family, batching, prompts, one_at_a_time
):
    stages = [batching[n] for n in names]
    widths = Widths(stages)
    try:
        with LocalPipeline(_config(family, names, relay_above=relay_above, tree=tree), stages=stages) as p:
            relayed = 0
            for params, want in zip(sampling_cases(), one_at_a_time):
                futures = [p.submit(prompt_token_ids=q, **_kwargs(params)) for q in prompts]
                assert [f.result().token_ids for f in futures] == want, params
                relayed += sum(s.relayed_drafts for f in futures for s in f.result().stats.stages)
    finally:
        for stage in stages:
            del stage.forward_batch
    assert widths.most > 1  # forwards did carry several requests
    assert (relayed > 0) is (relay_above is not None)
    assert (widths.siblings > 0) is (tree is not None)


@pytest.mark.parametrize("relay_above, tree", [(None, None), (2, None), (None, TREE)], ids=["checked", "relay", "tree"])
def test_a_dream_chain_with_images_in_flight_answers_as_the_target_alone(relay_above, tree, world):  # noqa: F811
    """With `relay_above`, DREAM passes drafts on while more than 2 are open, then steps again for the last two,
    on the target's features of the positions it relayed. With `tree`, DREAM offers siblings and the target checks
    trees, DREAM reading the target's features of each accepted path."""
    kinds = {"tiny": "causal_lm", "dream": "dream", "target": "vlm"}
    requests = image_requests()
    with LocalPipeline(_config(world, ["target"], kinds)) as p:
        want = [p.generate(**dict(r, max_new_tokens=NEW_TOKENS)).token_ids for r in requests]
    with LocalPipeline(_config(world, ["tiny", "dream", "target"], kinds, relay_above, tree)) as p:
        widths = Widths(p.stages)
        generations = run_all(p, requests, NEW_TOKENS)
    assert [g.token_ids for g in generations] == want
    assert widths.most > 1
    relayed = sum(s.relayed_drafts for g in generations for s in g.stats.stages)
    assert (relayed > 0) is (relay_above is not None)  # (DREAM's trees checked: tests/test_dream.py)


def test_requests_past_the_kv_budget_wait_for_memory_and_answer_the_same(family, prompts, one_at_a_time):
    """A target whose KV budget holds two requests' caches: sixteen in flight all answer, each as alone, and the
    caches held never pass the budget (the others waited to be opened, pipespec.stages.kv_pool)."""
    from pipespec.schema.kinds import ModelOptions

    probe = CausalLMStage(StageSpec("target", "causal_lm", family["target"], dtype="float32"))
    size = probe.caches.size_for(len(prompts[0]) + NEW_TOKENS + probe.shapes.widths[-1])
    budget = 2 * probe.caches.bytes_for(size)
    options = ModelOptions(kv_budget_gib=budget / 2**30)
    target = CausalLMStage(
        StageSpec("target", "causal_lm", family["target"], dtype="float32", options=options, max_batch=MAX_BATCH)
    )
    most, take = [0], target.caches.take

    def counted(size: int):
        cache = take(size)
        most[0] = max(most[0], target.caches.in_use)
        return cache

    target.caches.take = counted
    with LocalPipeline(_config(family, ["target"]), stages=[target]) as p:
        futures = [p.submit(prompt_token_ids=q, **_kwargs(sampling_cases()[0])) for q in prompts]
        assert [f.result().token_ids for f in futures] == one_at_a_time[0]
    assert most[0] == budget  # two at a time, never more


def test_logprobs_and_a_cancelled_request_in_a_batch(family, batching, prompts):
    """Under batching a request's logprobs are its own alone (bitwise), and one request cancelled mid-stream
    leaves the others of its forwards whole."""
    names = ["tiny", "target"]
    with LocalPipeline(_config(family, ["target"]), stages=[batching["target"]]) as p:
        want = [p.generate(prompt_token_ids=q, max_new_tokens=NEW_TOKENS, logprobs=2) for q in prompts[:6]]
    with LocalPipeline(_config(family, names), stages=[batching[n] for n in names]) as p:
        leaving = p.stream(prompt_token_ids=prompts[6], max_new_tokens=64)
        futures = [p.submit(prompt_token_ids=q, max_new_tokens=NEW_TOKENS, logprobs=2) for q in prompts[:6]]
        next(leaving)  # its first tokens are in: it leaves, the others' forwards go on without it
        leaving.close()
        got = [f.result() for f in futures]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.logprobs for g in got] == [w.logprobs for w in want]


class Prefills:
    """Spies on a stage's `prefill_batch` and `forward_batch`: each forward's kind and requests, in order."""

    def __init__(self, stage):
        self.stage, self.forwards = stage, []
        prefill, forward = stage.prefill_batch, stage.forward_batch
        stage.prefill_batch = lambda sessions: self.forwards.append(("prefill", [id(s) for s in sessions])) or prefill(sessions)
        stage.forward_batch = lambda feeds: self.forwards.append(("step", [id(f.session) for f in feeds])) or forward(feeds)

    def close(self) -> None:
        del self.stage.prefill_batch, self.stage.forward_batch


def test_prompts_in_small_chunks_answer_as_the_target_alone(family, prompts, one_at_a_time):
    """Prompts fed 5 tokens a forward, several requests' chunks in one, 16 in flight: every answer is the one the
    target gives with each prompt fed whole, one request at a time (a chunk's cache is what a whole prefill
    leaves, wherever the chunks start and whatever rides with them)."""
    from pipespec.schema.kinds import ModelOptions

    options = ModelOptions(prefill_chunk=5)
    target = CausalLMStage(
        StageSpec("target", "causal_lm", family["target"], dtype="float32", options=options, max_batch=MAX_BATCH)
    )
    spy = Prefills(target)
    try:
        with LocalPipeline(_config(family, ["target"]), stages=[target]) as p:
            for params, want in zip(sampling_cases(), one_at_a_time):
                futures = [p.submit(prompt_token_ids=q, **_kwargs(params)) for q in prompts]
                assert [f.result().token_ids for f in futures] == want, params
    finally:
        spy.close()
    assert max(len(ids) for kind, ids in spy.forwards if kind == "prefill") > 1  # chunks of several requests rode together


def test_a_long_prompt_goes_in_between_the_streams_steps(family, prompts):
    """A 100-token prompt arriving while a request streams goes in by chunks, the stream's steps between them: it
    does not stall the stream for its whole prefill; both answer as they do alone."""
    from pipespec.schema.kinds import ModelOptions

    long_prompt = [t for line in prompt_ids(family["target"], 12, length=40, seed=5) for t in line][:100]
    options = ModelOptions(prefill_chunk=8)
    target = CausalLMStage(
        StageSpec("target", "causal_lm", family["target"], dtype="float32", options=options, max_batch=MAX_BATCH)
    )
    with LocalPipeline(_config(family, ["target"]), stages=[target]) as p:
        want = [p.generate(prompt_token_ids=q, max_new_tokens=48).token_ids for q in (prompts[0], long_prompt)]
        spy = Prefills(target)
        try:
            stream = p.stream(prompt_token_ids=prompts[0], max_new_tokens=48)
            first = next(stream)
            late = p.submit(prompt_token_ids=long_prompt, max_new_tokens=48)
            streamed = list(first.token_ids) + [t for delta in stream for t in delta.token_ids]
            assert [streamed, list(late.result().token_ids)] == [list(w) for w in want]
        finally:
            spy.close()
    kinds = [kind for kind, _ in spy.forwards]
    first_chunk, last_chunk = kinds.index("prefill"), len(kinds) - 1 - kinds[::-1].index("prefill")
    assert len(long_prompt) == 100 and kinds.count("prefill") >= 99 // 8  # the long prompt's chunks, one a forward
    assert "step" in kinds[first_chunk:last_chunk]  # the stream stepped while the long prompt went in
