"""Exact logprobs through the engine: what a request asking for them gets does not depend on the drafters.

The target computes each committed token's logprob and its k most likely alternatives from its own
logits at the token's position (pipespec.engine.sampling.token_logprobs), sends them with its commits, and
the coordinator streams them beside the token ids. Checked on random-weight fp32 toy Llamas
(tests.fixtures.toy_models), a 3-stage chain at two lookaheads, greedy, coupled sampling and
rejection sampling, against two references within TOL:

- the target alone (a 1-stage `LocalPipeline`), up to the first token where the outputs differ at a
  genuine near-tie (`tests.fixtures.exactness.assert_same`; none is expected);
- an independent one: one full forward of the Hugging Face target model over prompt + generated
  tokens, its rows processed as documented (greedy: log-softmax of the raw logits; sampling: the
  processed distribution `log_processed`), written out here rather than calling `token_logprobs`.

Also: through the gRPC `Client` against a served coordinator (the wire's chunks carry them), cut
short by a stop string or a stop token in the middle of a commit (as many logprobs as token ids),
across a rejoin after the target is restored (only new commits carry them, none lost or repeated),
and never computed by a stage other than the target.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest
import torch
from transformers import AutoTokenizer

from pipespec import Client, LocalPipeline
from pipespec.config import StageSpec, sub_pipeline
from pipespec.engine.sampling import log_processed
from pipespec.engine.step import StepPlan, compute
from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.messages import Closed, Commit, RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.protocol.stats import StageStats
from pipespec.serving.coordinator import Coordinator
from pipespec.stages.causal_lm import CausalLMStage
from pipespec.stages.mock import MockStage
from tests.fixtures.exactness import assert_same, text_pipeline
from tests.fixtures.faults import kill_stage, mock3, restore_stage
from tests.fixtures.recorder import Sent
from tests.fixtures.toy_models import prompt_ids

TOL = 1e-5
CHAIN = ["tiny", "mid", "target"]
NEW_TOKENS = 12
K = 5
CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=2),
]


@pytest.fixture(scope="module")
def loaded(family):
    return {name: CausalLMStage(StageSpec(name, "causal_lm", family[name], dtype="float32")) for name in CHAIN}


@pytest.fixture(scope="module")
def prompts(family):
    return prompt_ids(family["target"], 3, length=10, seed=11)


def keywords(params: SamplingParams, k: int = K) -> dict:
    return dict(
        max_new_tokens=NEW_TOKENS,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        logprobs=k,
    )


def hf_logprobs(model, prompt: Sequence[int], tokens: Sequence[int], params: SamplingParams, k: int) -> list[TokenLogprobs]:
    """The independent reference: one forward over prompt + tokens, each token's row processed as documented."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0]  # [P + n, V]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]  # [n, V]: the rows that predict `tokens`
    logp = torch.log_softmax(rows.double(), dim=-1) if params.greedy else log_processed(rows, params)
    out = []
    for row, token in zip(logp.tolist(), tokens):
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]  # most likely first, ties to the lower id
        out.append(TokenLogprobs(token, row[token], tuple(order), tuple(row[i] for i in order)))
    return out


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= TOL  # -inf == -inf


def assert_logprobs_close(got: Sequence[TokenLogprobs], want: Sequence[TokenLogprobs]) -> None:
    """Same tokens, logprobs within TOL; the same top ids, but for two swapped at a near-tie (within TOL)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"token {i}: {g} vs {w}"
        assert g.token == w.token and close(g.logprob, w.logprob), where
        assert len(g.top_ids) == len(w.top_ids) == len(g.top_logprobs), where
        assert all(close(a, b) for a, b in zip(g.top_logprobs, w.top_logprobs)), where
        for j, (a, b) in enumerate(zip(g.top_ids, w.top_ids)):
            neighbours = [m for m in (j - 1, j + 1) if 0 <= m < len(w.top_ids)]
            assert a == b or any(close(w.top_logprobs[m], w.top_logprobs[j]) for m in neighbours), where


def assert_exact(got, want, prompt, params, target_model) -> None:
    """`got`'s logprobs equal the target alone's `want` (up to a near-tie where the tokens part) and the
    Hugging Face reference on `got`'s own tokens."""
    assert len(got.logprobs) == len(got.token_ids) and [lp.token for lp in got.logprobs] == got.token_ids
    assert_same(got.token_ids, want.token_ids, prompt, params, target_model)
    same = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), len(got.token_ids))
    assert_logprobs_close(got.logprobs[:same], want.logprobs[:same])
    assert_logprobs_close(got.logprobs, hf_logprobs(target_model, prompt, got.token_ids, params, K))


@pytest.mark.parametrize("lookahead", [1, 4])
def test_a_chain_reports_the_logprobs_of_the_target_alone(lookahead, family, loaded, prompts, reference, target_model):
    with text_pipeline(family, loaded, CHAIN, lookahead) as p:
        accepted = 0
        for params in CASES:
            futures = [
                (q, p.submit(prompt_token_ids=q, **keywords(params)), reference.submit(prompt_token_ids=q, **keywords(params)))
                for q in prompts
            ]
            for q, fut, ref in futures:
                got = fut.result()
                assert_exact(got, ref.result(), q, params, target_model)
                assert all(math.isfinite(lp.logprob) for lp in got.logprobs)  # a chosen token always has mass
                accepted += sum(pair.num_accepted_tokens for pair in got.stats.pairs)
        assert accepted > 0, "no draft was ever accepted: the test would not exercise verified tokens"


def test_rejection_sampling_reports_the_targets_processed_distribution(family, loaded, prompts, target_model):
    with text_pipeline(family, loaded, CHAIN, 3, sampling={"verify": "rejection"}) as p:
        for seed, params in enumerate([SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9, top_k=50)]):
            params = SamplingParams(params.temperature, params.top_p, params.top_k, seed)
            for q in prompts:
                got = p.generate(prompt_token_ids=q, **keywords(params))
                assert [lp.token for lp in got.logprobs] == got.token_ids
                assert all(math.isfinite(lp.logprob) for lp in got.logprobs)
                assert_logprobs_close(got.logprobs, hf_logprobs(target_model, q, got.token_ids, params, K))


def test_no_logprobs_unless_asked_and_no_alternatives_for_zero(family, loaded, prompts, reference):
    with text_pipeline(family, loaded, CHAIN) as p:
        plain = p.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS)
        zero = p.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS, logprobs=0)
    assert plain.logprobs == [] and zero.token_ids == plain.token_ids
    assert [(lp.token, lp.top_ids, lp.top_logprobs) for lp in zero.logprobs] == [(t, (), ()) for t in plain.token_ids]
    want = reference.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS, logprobs=1).logprobs
    assert all(close(a.logprob, b.logprob) for a, b in zip(zero.logprobs, want, strict=True))


def test_the_client_receives_them_over_grpc(family, loaded, prompts, reference, target_model):
    from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator

    params = SamplingParams(temperature=0.8, top_k=2, seed=4)  # 3 of the 5 alternatives have no mass: -inf on the wire
    with text_pipeline(family, loaded, CHAIN, over_grpc=True) as p:
        service = CoordinatorService(p.serving, "logprobs")
        server, port = asyncio.run_coroutine_threadsafe(serve_coordinator(service, "127.0.0.1", 0), p.loop).result()
        try:
            client = Client(f"127.0.0.1:{port}")
            deltas = list(client.stream(prompt_token_ids=prompts[1], **keywords(params)))
            got = client.generate(prompt_token_ids=prompts[1], **keywords(params))
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(grace=None), p.loop).result()
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas) and deltas[-1].finish_reason == "length"
    assert all(x.top_logprobs[2:] == (-math.inf,) * 3 for x in got.logprobs)
    want = reference.generate(prompt_token_ids=prompts[1], **keywords(params))
    assert_exact(got, want, prompts[1], params, target_model)
    streamed = [x for d in deltas for x in d.logprobs]
    assert [t for d in deltas for t in d.token_ids] == got.token_ids
    assert_logprobs_close(streamed, got.logprobs)  # not bit for bit: another run, other blocks of drafts


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(family, loaded, prompts):
    tok = AutoTokenizer.from_pretrained(family["target"])
    with text_pipeline(family, loaded, CHAIN) as p:
        full = p.generate(prompt_token_ids=prompts[2], **keywords(CASES[0]))
        middle = tok.decode(full.token_ids[NEW_TOKENS // 2 : NEW_TOKENS // 2 + 1])
        assert middle.strip(), f"no text to stop at: {full.token_ids}"
        stopped = p.generate(prompt_token_ids=prompts[2], stop=[middle], **keywords(CASES[0]))
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < NEW_TOKENS
    assert len(stopped.logprobs) == len(stopped.token_ids)
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert_logprobs_close(stopped.logprobs, full.logprobs[: len(stopped.logprobs)])


# ---- the coordinator, the step and a rejoin, on their own ------------------------------------------


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -float(token), (token,), (-float(token),))


def test_the_coordinator_streams_a_commits_logprobs_up_to_a_stop_token():
    async def run() -> list:
        coordinator = Coordinator(["t"], None)
        coordinator.connect([Sent()])
        spec = RequestSpec("r", (1,), SamplingParams(), 8, frozenset({6}), logprobs=1)
        stream = coordinator.generate(spec)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # opened
        coordinator.deliver(Commit("r", 0, (4, 5), (lp(4), lp(5))))
        coordinator.deliver(Commit("r", 2, (6, 7, 8), (lp(6), lp(7), lp(8))))  # the stop token, then two past it
        coordinator.deliver(Closed("r", "t", StageStats("t")))
        return [await first] + [d async for d in stream]

    deltas = asyncio.run(run())
    assert [d.token_ids for d in deltas] == [(4, 5), (6,), ()]
    assert [d.logprobs for d in deltas] == [(lp(4), lp(5)), (lp(6),), ()]
    assert deltas[-1].finish_reason == "stop"


def top3(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -1.0, (token, 1, 2), (-1.0, -2.0, -3.0))


@pytest.mark.parametrize("asked", [None, 0, 2])
def test_a_learning_first_stage_gets_every_commit_with_its_top_and_the_client_what_it_asked(asked):
    """The coordinator of a STAND drafter (`learns_top`): the target computes at least that many top logprobs, the
    first stage is relayed each commit up to a stop token, and the client sees only the logprobs it asked for."""

    async def run() -> tuple[list, Sent, Sent]:
        coordinator = Coordinator(["stand", "t"], None, learns_top=3)
        first, target = Sent(), Sent()
        coordinator.connect([first, target])
        stream = coordinator.generate(RequestSpec("r", (1,), SamplingParams(), 8, frozenset({6}), logprobs=asked))
        head = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # opened
        coordinator.deliver(Commit("r", 0, (4, 5), (top3(4), top3(5))))
        coordinator.deliver(Commit("r", 2, (6, 7), (top3(6), top3(7))))  # the stop token, then one past it
        coordinator.deliver(Closed("r", "stand", StageStats("stand")))
        coordinator.deliver(Closed("r", "t", StageStats("t")))
        return [await head] + [d async for d in stream], first, target

    deltas, first, target = asyncio.run(run())
    assert target.sent[0].request.logprobs == max(asked or 0, 3)
    relayed = [m for m in first.sent if isinstance(m, Commit)]
    assert relayed == [Commit("r", 0, (4, 5), (top3(4), top3(5))), Commit("r", 2, (6,), (top3(6),))]
    assert [d.token_ids for d in deltas] == [(4, 5), (6,), ()]
    got = [lp for d in deltas for lp in d.logprobs]
    if asked is None:
        assert got == []
    else:
        assert [(lp.token, len(lp.top_ids), len(lp.top_logprobs)) for lp in got] == [(t, asked, asked) for t in (4, 5, 6)]


def test_a_relay_that_fails_costs_the_learner_not_the_request():
    class Broken(Sent):
        def send(self, message) -> None:
            if isinstance(message, Commit):
                raise RuntimeError("the link broke")
            super().send(message)

    async def run() -> list:
        coordinator = Coordinator(["stand", "t"], None, learns_top=3)
        coordinator.connect([Broken(), Sent()])
        stream = coordinator.generate(RequestSpec("r", (1,), SamplingParams(), 2))
        head = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        coordinator.deliver(Commit("r", 0, (4, 5), (top3(4), top3(5))))
        coordinator.deliver(Closed("r", "stand", StageStats("stand")))
        coordinator.deliver(Closed("r", "t", StageStats("t")))
        return [await head] + [d async for d in stream]

    deltas = asyncio.run(run())
    assert [d.token_ids for d in deltas] == [(4, 5), ()] and deltas[-1].finish_reason == "length"


def test_a_commit_without_the_logprobs_asked_for_fails_its_request():
    async def run() -> list:
        coordinator = Coordinator(["t"], None)
        coordinator.connect([Sent()])
        stream = coordinator.generate(RequestSpec("r", (1,), SamplingParams(), 8, logprobs=2))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        coordinator.deliver(Commit("r", 0, (4, 5), (lp(4),)))
        coordinator.deliver(Closed("r", "t", StageStats("t")))
        return [await first] + [d async for d in stream]

    (delta,) = asyncio.run(run())
    assert delta.finish_reason == "error" and "a commit of 2 tokens has 1 logprobs" in delta.error


def test_only_the_target_computes_them():
    stage = MockStage(mock3().stages[-1])
    spec = RequestSpec("r", (1, 2, 3), SamplingParams(temperature=0.8), 8, logprobs=2)
    for depth, expect in [(1, False), (0, True)]:
        session = stage.open(spec)
        plan = StepPlan("r", 0, 0, session.prompt_len - 1, (3,), 0, (), None)
        outcome = compute(stage, plan, session, spec, depth, False, 0.0)
        decision, _, _ = outcome.result
        assert (decision.logprobs is not None) is expect, depth
    assert [x.token for x in decision.logprobs] == list(decision.tokens) and len(decision.logprobs[0].top_ids) == 2


def test_a_rejoin_after_the_target_is_restored_keeps_them_whole():
    config = mock3()
    prompt, n = (3, 5, 7), 64
    with LocalPipeline(sub_pipeline(config, ["target"])) as target:
        want = target.generate(prompt_token_ids=prompt, max_new_tokens=n, logprobs=3)
    with LocalPipeline(config) as pipe:
        head = pipe.stream(prompt_token_ids=prompt, max_new_tokens=n, logprobs=3)
        deltas = [next(d for d in head if d.token_ids)]
        kill_stage(pipe, 2)
        restore_stage(pipe, 2)
        assert pipe._on_loop(lambda: [live.rejoins for live in pipe.coordinator.live.values()]) == [1]  # still running
        deltas += list(head)
    assert deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert_logprobs_close([x for d in deltas for x in d.logprobs], want.logprobs)
