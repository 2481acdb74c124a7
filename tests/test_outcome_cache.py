"""Pre-drafted branches never send a stale token (pipespec.engine.outcome_cache, pipespec.engine.runner).

A first-stage drafter's runner is driven by hand, turn by turn, against a scripted verifier: random
verdicts at random positions (rejections with one of the tokens the drafter ranked next, which its
branches foresee, or with any other token; confirmations; full acceptance with its own likeliest next token or
another), a third of them with tokens after the verdict's own (a branch the verifier took: its drafter's own
continuation or random tokens). Its model is a labelled mock whose logits depend on the whole context it was fed, so a cache
entry a branch's forward left where the runner believes another line's is changes the next token. Every
draft of the verifier's current epoch must be exactly what the drafter's own steps give on the line the
verifier knows; the branches must have been used (hits, tokens served without a forward).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch

from pipespec.engine.choice import decide
from pipespec.engine.outcome_cache import ALTERNATIVES, Doubt, OutcomeCache
from pipespec.engine.runner import StageRunner
from pipespec.engine.scheduler import Done
from pipespec.engine.stage import check_keep, check_length
from pipespec.engine.step import StepPlan, _doubts
from pipespec.protocol.messages import Close, Draft, Open, RequestSpec, Verdict
from pipespec.protocol.params import SamplingParams, VerifyMode
from tests.fixtures.recorder import Sent

VOCAB = 12
PROMPT = (3, 1, 4, 1, 5)


def logits_after(context: Sequence[int]) -> torch.Tensor:
    """[V] the mock's logits for the token after `context`: a function of all of it."""
    generator = torch.Generator().manual_seed(hash(tuple(context)) & 0xFFFF_FFFF)
    return 2.0 * torch.randn(VOCAB, generator=generator)


class WholeContextSession:
    """A mock drafter's session: the context it was fed stands for its KV cache."""

    def __init__(self, prompt: Sequence[int]):
        self.context = list(prompt[:-1])
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        check_keep("mock", keep, len(self.context))
        del self.context[keep:]
        self.context.extend(tokens)
        check_length("mock", len(self.context), keep + len(tokens))
        return torch.stack([logits_after(self.context[: i + 1]) for i in range(keep, len(self.context))])

    def close(self) -> None:
        self.context = []


class WholeContextTreeSession(WholeContextSession):
    """The same, growing side lines in its forward (pipespec.engine.stage.TreeSession): a side's row is a function
    of its whole line, so a side fed from the wrong base, or missing a token, changes it."""

    def forward_tree(
        self, keep: int, tokens: Sequence[int], sides: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for base, _ in sides:
            check_keep("mock", base, keep)
        rows = [logits_after(self.context[:base] + list(side)) for base, side in sides]
        return self.forward(keep, tokens), torch.stack(rows)


class WholeContextStage:
    """A mock stage (for protocol tests): a WholeContextSession per request (`tree`: a WholeContextTreeSession)."""

    name = "mock"
    vocab_size = VOCAB
    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, tree: bool = False):
        self.tree = tree

    def open(self, request: RequestSpec) -> WholeContextSession:
        return (WholeContextTreeSession if self.tree else WholeContextSession)(request.prompt_token_ids)


def pump(runner: StageRunner) -> int:
    """Let the runner do all it wants to, on this thread: each forward run at once, its result taken.
    -> the branches grown beside those forwards (riders)."""
    riders = 0
    while True:
        runner._flush()
        batch = runner.next_batch()
        if batch is None:
            return riders
        riders += sum(len(plan.riders) for plan in batch.plans if isinstance(plan, StepPlan))
        future: Future = Future()
        future.set_result(runner.launch(batch)())
        runner.scheduler.running = runner
        runner._receive(Done(batch, future))


def expected(line: Sequence[int], position: int, params: SamplingParams) -> tuple[int, torch.Tensor | None]:
    """The drafter's own token at `position` after `line` (generated tokens), as its steps decide it, and its
    p' there (rejection sampling; else None)."""
    row = logits_after(PROMPT + tuple(line[:position]))
    decision = decide(row[None], (), None, params, position, 1)
    return decision.tokens[0], None if decision.probs is None else decision.probs[0]


def _branch(rng: random.Random, line: list[int], max_new_tokens: int, params: SamplingParams) -> list[int]:
    """What a verifier's own pre-drafted branch puts after `line` in a verdict (pipespec.messages.Verdict.after): nothing
    most of the time; else a few tokens, the drafter's own continuation (its branch there agrees) or random ones."""
    if rng.random() < 0.7:
        return []
    own, tokens = rng.random() < 0.5, []  # own: short, so that a branch of the drafter's can hold more
    for _ in range(min(rng.randint(1, 2 if own else 4), max_new_tokens - len(line))):
        tokens.append(expected(line + tokens, len(line) + len(tokens), params)[0] if own else rng.randrange(VOCAB))
    return tokens


@pytest.mark.parametrize("tree", [False, True], ids=["one-line", "tree"])
@pytest.mark.parametrize("seed", range(6))
def test_random_verdicts_never_get_a_stale_draft(seed, tree):
    """`tree`: branches grow beside every step (riders); else one forward a token, at the lookahead bound."""
    rng = random.Random(seed)
    modes = (
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=seed),
        SamplingParams(temperature=1.0, seed=seed, verify=VerifyMode.REJECTION),
    )
    params = modes[seed % 3]
    runner = StageRunner(WholeContextStage(tree), name="drafter", depth=1, max_lookahead=rng.randint(2, 6), predraft=6)
    verifier, coordinator = Sent(), Sent()
    runner.connect(downstream=verifier, coordinator=coordinator)
    spec = RequestSpec("r", PROMPT, params, max_new_tokens=80)
    runner._receive(Open(spec))
    line: list[int] = []  # the drafter's tokens as the verifier knows them
    epoch = verified = riders = 0
    stats = runner.requests["r"].req.stats
    try:
        while verified < spec.max_new_tokens:
            riders += pump(runner)
            for message in verifier.sent:
                if isinstance(message, Draft) and message.epoch == epoch:
                    assert message.start <= len(line), "a gap in the drafts"
                    for i, token in enumerate(message.tokens):
                        at = message.start + i
                        if at < len(line):
                            assert token == line[at], f"a re-sent draft differs at {at}"
                        else:
                            want, q = expected(line, at, params)
                            assert token == want, f"a stale draft at {at}: {message}"
                            assert q is None or torch.equal(message.probs[i], q), f"a stale q row at {at}"
                            line.append(token)
            verifier.sent.clear()
            p = rng.randint(verified, min(len(line), spec.max_new_tokens - 1))
            if p == len(line):  # full acceptance, and our bonus token
                token = expected(line, p, params)[0] if rng.random() < 0.6 else rng.randrange(VOCAB)
            else:
                ranked = logits_after(PROMPT + tuple(line[:p])).topk(ALTERNATIVES + 1).indices.tolist()
                foreseen = [t for t in ranked if t != line[p]][:ALTERNATIVES]  # the tokens we ranked next
                choice = rng.random()
                token = line[p] if choice < 0.2 else rng.choice(foreseen) if choice < 0.7 else rng.randrange(VOCAB)
            after = _branch(rng, line[:p] + [token], spec.max_new_tokens, params)  # the verifier's own, sometimes
            told, held = [token, *after], line[p : p + 1 + len(after)]
            epoch += told[: len(held)] != held  # the verifier contradicts a draft: a new epoch
            if told != held:  # else a confirmation: the drafter keeps its tokens
                line[p:] = told
            verified = p + 1 + len(after)
            runner._receive(Verdict("r", epoch, p, token, tuple(after)))
        assert stats.predraft_forwards > 0 and stats.predraft_hits > 0 and stats.predraft_tokens > 0, stats
        assert (riders > 0) == tree, riders
    finally:
        runner._receive(Close("r"))
        runner.scheduler.shutdown(wait=True)


def test_branches_follow_the_likeliest_verdicts_and_drop_with_them():
    cache = OutcomeCache(fanout=3, depth=2)
    others = [((10, 0.05), (20, 0.03)), ((11, 0.35), (21, 0.2)), ((12, 0.2), (22, 0.05)), ((13, 0.03), (23, 0.01))]
    cache.decided(0, [Doubt(c, o) for c, o in zip([0.9, 0.4, 0.7, 0.95], others)])
    # verified 1: 11 at 1 is 0.35 likely, 21 at 1 0.2, 12 at 2 0.4 * 0.2, full acceptance 0.4 * 0.7 * 0.95
    first = cache.to_grow(length=4, verified=1, fed=8, prompt_len=5)
    assert (first.position, first.token, first.fed) == (1, 11, 6)
    cache.grown(first, 7, None, 7, full=False)
    cache.grown(first, 8, None, 8, full=False)
    assert first.tokens == [7, 8] and first.done
    full = cache.to_grow(length=4, verified=1, fed=8, prompt_len=5)
    assert (full.position, full.token, full.fed) == (4, None, 8)
    cache.grown(full, 9, None, 9, full=True)
    assert full.token == 9 and full.tokens == [] and full.done
    second = cache.to_grow(length=4, verified=1, fed=8, prompt_len=5)  # our third choice at 1
    assert (second.position, second.token, second.fed) == (1, 21, 6)
    assert cache.to_grow(length=4, verified=1, fed=8, prompt_len=5) is second  # still growing
    second.done = True
    assert cache.to_grow(length=4, verified=1, fed=8, prompt_len=5) is None  # the fanout is reached
    cache.overwritten(5)
    assert first.fed == 5 and full.fed == 5
    assert cache.verdict(1, 1, changed=False) is None and 1 not in [b.position for b in cache.branches]  # confirmed
    assert cache.verdict(4, 9, changed=True) is full and cache.branches == [] and cache.doubts == {}
    cache.decided(0, [Doubt(c, o) for c, o in zip([0.9, 0.3], others)])
    opened = []  # verified 1: 11 at 1 is 0.35 likely, full acceptance 0.3, 21 at 1 0.2
    for _ in range(3):
        opened.append(cache.to_grow(length=2, verified=1, fed=6, prompt_len=5))
        opened[-1].done = True
    assert [(b.position, b.token) for b in opened] == [(1, 11), (2, None), (1, 21)]
    assert cache.verdict(1, 21, changed=True) is opened[2]  # our third choice was the verifier's


def test_a_middle_stage_hands_its_drafter_the_branch_it_took():
    """A verifier that drafts (a chain's middle stage) pre-drafts too: when its verifier's verdict takes one of
    its branches, its own drafter hears the verdict's token and the branch's tokens in one Verdict (`after`),
    and the branch goes downstream at once."""
    runner = StageRunner(
        WholeContextStage(tree=True), name="middle", depth=1, max_lookahead=6,
        drafter_name="drafter", drafter_lookahead=8, verify_window=4, predraft=2,
    )  # fmt: skip
    runner.loop = asyncio.new_event_loop()  # its clock, for patience; never run: this test turns the runner by hand
    drafter, verifier, coordinator = Sent(), Sent(), Sent()
    runner.connect(upstream=drafter, downstream=verifier, coordinator=coordinator)
    spec = RequestSpec("r", PROMPT, SamplingParams(), max_new_tokens=40)
    line: list[int] = []
    for _ in range(6):
        line.append(expected(line, len(line), spec.params)[0])
    try:
        runner._receive(Open(spec))
        pump(runner)
        runner._receive(Draft("r", 0, 0, tuple(line[:4])))  # what the middle stage itself would decide: all accepted
        pump(runner)
        runner._receive(Draft("r", 0, 5, (line[5],)))
        pump(runner)  # at its lookahead bound now: it grows its branches
        req = runner.requests["r"].req
        assert req.tokens == line and req.outcomes.branches, req.outcomes
        branch = max(req.outcomes.branches, key=lambda b: len(b.tokens))
        assert branch.token is not None and branch.tokens, branch
        drafter.sent.clear(), verifier.sent.clear()
        runner._receive(Verdict("r", 1, branch.position, branch.token))
        runner._flush()
        want = line[: branch.position] + [branch.token]
        while len(want) < branch.position + 1 + len(branch.tokens):
            want.append(expected(want, len(want), spec.params)[0])
        [told] = drafter.sent
        assert (told.epoch, told.position, told.token) == (1, branch.position, branch.token)
        assert list(told.after) == want[branch.position + 1 :]  # its own continuation, as its steps decide it
        [draft] = verifier.sent
        assert (draft.epoch, draft.start, list(draft.tokens)) == (1, branch.position + 1, want[branch.position + 1 :])
        assert (req.stats.predraft_hits, req.stats.predraft_tokens) == (1, len(told.after))
    finally:
        runner._receive(Close("r"))
        runner.scheduler.shutdown(wait=True)
        runner.loop.close()


def test_a_drafter_takes_its_branch_past_the_tokens_its_verifier_took():
    """A verdict whose `after` (its verifier's own branch) agrees with the start of the drafter's branch for that
    outcome: the drafter's branch serves what it holds past them, with its q rows, at once."""
    params = SamplingParams(temperature=1.0, seed=5, verify=VerifyMode.REJECTION)
    runner = StageRunner(WholeContextStage(tree=True), name="drafter", depth=1, max_lookahead=6, predraft=2)
    verifier, coordinator = Sent(), Sent()
    runner.connect(downstream=verifier, coordinator=coordinator)
    spec = RequestSpec("r", PROMPT, params, max_new_tokens=40)
    try:
        runner._receive(Open(spec))
        pump(runner)  # drafts to its bound, its branches riding beside
        req = runner.requests["r"].req
        branch = max((b for b in req.outcomes.branches if b.token is not None), key=lambda b: len(b.tokens))
        assert len(branch.tokens) >= 2, req.outcomes.branches
        line = req.tokens[: branch.position] + [branch.token] + branch.tokens
        verifier.sent.clear()
        runner._receive(Verdict("r", 1, branch.position, branch.token, tuple(branch.tokens[:1])))
        runner._flush()
        [draft] = verifier.sent
        assert (draft.start, list(draft.tokens)) == (branch.position + 2, line[branch.position + 2 :])
        for i, at in enumerate(range(draft.start, len(line))):
            assert torch.equal(draft.probs[i], expected(line, at, params)[1]), f"a stale q row at {at}"
        assert (req.stats.predraft_hits, req.stats.predraft_tokens) == (1, len(branch.tokens) - 1)
    finally:
        runner._receive(Close("r"))
        runner.scheduler.shutdown(wait=True)


def test_a_step_doubts_each_decided_token_with_the_likeliest_others():
    """pipespec.engine.step: per decided token, its probability and the ALTERNATIVES likeliest other tokens',
    whether or not ours was the likeliest (sampling); a vocabulary of 2 has one other."""
    rows = torch.tensor([[0.1, 0.5, 0.25, 0.15], [0.4, 0.3, 0.2, 0.1]]).log()
    doubts = _doubts(rows, (1, 2))
    assert ALTERNATIVES == 2
    assert [(round(d.chosen_p, 6), [(t, round(q, 6)) for t, q in d.others]) for d in doubts] == [
        (0.5, [(2, 0.25), (3, 0.15)]),
        (0.2, [(0, 0.4), (1, 0.3)]),
    ]
    assert [t for t, _ in _doubts(torch.zeros(1, 2), (0,))[0].others] == [1]
