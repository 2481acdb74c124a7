"""Synchronous speculative decoding (Leviathan et al.), the baseline the pipeline must beat.

The same stages, sessions and choice function as the pipeline, in one thread and in lock step: the
drafter proposes `gamma` tokens one forward at a time, then the target verifies them in one forward,
then the drafter waits for the verdict. With `drafter=None` it is plain decoding with the target
alone. Like the pipeline, its output equals the target alone token for token (greedy, coupled). A
DREAM drafter gets the target's features after each verification, as in the pipeline (pipespec.engine.handoff); a
STAND drafter learns each commit, with the target's top logprobs, as its coordinator relays them in a pipeline.
With a `TreeShape` the drafter grows a draft tree instead of `gamma` drafts (pipespec.engine.tree_drafting) and the
target verifies it in one tree forward (pipespec.engine.tree_verification).
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import torch

from pipespec.engine.choice import decide
from pipespec.engine.draft_tree import DraftTree
from pipespec.engine.handoff import hand_prefill, step_message
from pipespec.engine.sampling import token_logprobs
from pipespec.engine.stage import CommitLearner, DraftTreeSession, FeatureReader, Session, Stage, TreeNodes, unfed_tail
from pipespec.engine.tree_drafting import LineExpander, grow
from pipespec.engine.tree_verification import TreeVerify, verify_tree
from pipespec.protocol.messages import Commit, RequestSpec
from pipespec.protocol.stats import PairStats
from pipespec.protocol.tree_shape import TreeShape


class _Cursor:
    """One session plus how much of the token sequence its cache holds (context tokens)."""

    def __init__(self, session: Session):
        self.session = session
        self.last = session.last_prompt_token
        self.fed = session.prompt_len - 1
        self.fed_from = self.fed  # where the last `rows` call started feeding, and how many of our tokens it fed
        self.fed_own = 0

    def _unfed(self, tokens: list[int]) -> tuple[int, ...]:
        """The part of `tokens` the cache lacks, noted as what the next forward feeds of ours, and from where."""
        feed = unfed_tail(self.last, self.session.prompt_len, self.fed, tokens)
        self.fed_from, self.fed_own = self.fed, len(feed)
        return feed

    def rows(self, tokens: list[int], extra: tuple[int, ...] = ()) -> torch.Tensor:
        """Feed the unfed part of `tokens` plus `extra`; -> [len(extra) + 1, V] logits at len(tokens).."""
        feed = self._unfed(tokens)
        logits = self.session.forward(self.fed, feed + tuple(extra))
        self.fed = self.session.prompt_len + len(tokens) + len(extra)
        return logits[len(feed) - 1 :]

    def tree_rows(self, tokens: list[int], tree: DraftTree) -> torch.Tensor:
        """Feed the unfed part of `tokens`, then every node of `tree` in the same forward; -> [len(tree) + 1, V]
        logits: the root's (at len(tokens)), then each node's."""
        feed = self._unfed(tokens)
        logits = self.session.forward_nodes(self.fed, feed, TreeNodes(tree, tuple(range(len(tree)))))
        self.fed = self.session.prompt_len + len(tokens)
        return logits[len(feed) - 1 :]

    def keep_path(self, path: tuple[int, ...]) -> None:
        """After `tree_rows`: the accepted path's entries put in place, after the root."""
        self.session.keep_path(self.fed, path)
        self.fed += len(path)

    def keep(self, valid_tokens: int) -> None:
        self.fed = min(self.fed, self.session.prompt_len + valid_tokens)


@dataclass
class SyncResult:
    token_ids: list[int]
    pair: PairStats | None
    target_forwards: int
    prefill_s: float = 0.0  # start -> first committed token (the prompt's prefill and the first step)
    decode_s: float = 0.0  # first committed token -> finish
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed by each target forward
    trees: list[DraftTree] = field(default_factory=list)  # the drafts each target forward checked (a chain's: a line)


def generate_sync(
    target: Stage,
    spec: RequestSpec,
    drafter: Stage | None = None,
    gamma: int = 4,
    tree: TreeShape | None = None,
    method: TreeVerify = TreeVerify.TRAVERSAL,
) -> SyncResult:
    """`gamma` drafts a verification, or with `tree` a draft tree of its shape, verified by `method` under rejection sampling."""
    start_s = time.perf_counter()
    first_s = None
    t = _Cursor(target.open(spec))
    d = _Cursor(drafter.open(spec)) if drafter is not None else None
    features = d is not None and isinstance(d.session, FeatureReader)  # a DREAM drafter
    learner = drafter if isinstance(drafter, CommitLearner) else None  # a STAND drafter
    if tree is not None and d is not None:
        return _generate_tree(t, d, spec, tree, method, PairStats(drafter.name, target.name), start_s, learner)
    if features:
        hand_prefill(d.session, t.session, spec.request_id)
    pair = PairStats(drafter.name, target.name) if d else None
    tokens: list[int] = []
    forwards = 0
    accept_lengths: list[int] = []
    trees: list[DraftTree] = []
    try:
        while len(tokens) < spec.max_new_tokens and not (tokens and tokens[-1] in spec.stop_token_ids):
            n = min(gamma, spec.max_new_tokens - len(tokens) - 1) if d else 0
            drafts: list[int] = []
            probs = []
            for _ in range(n):
                step = decide(d.rows(tokens + drafts), (), None, spec.params, len(tokens) + len(drafts), 1)
                drafts.append(step.tokens[0])
                probs.append(step.probs[0] if step.probs is not None else None)
            q = torch.stack(probs) if n and spec.params.rejection else None
            start = len(tokens)
            t_rows = t.rows(tokens, tuple(drafts))  # [n + 1, V]
            decision = decide(t_rows, tuple(drafts), q, spec.params, start, 0)
            trees.append(DraftTree.chain(drafts))
            forwards += 1
            t.keep(start + decision.accepted)
            if features:  # the target's hidden states of its own tokens and the accepted drafts
                d.session.add_features(step_message(spec.request_id, t.fed_from, t.session.hidden, t.fed_own, decision.accepted))
            if d:
                d.keep(start + decision.accepted)
                pair.record(n, decision.accepted)
            accept_lengths.append(_commit(tokens, decision.tokens, spec.stop_token_ids))
            if learner is not None:
                _teach(learner, spec, start, tokens[start:], t_rows)
            first_s = first_s or time.perf_counter()
    finally:
        t.session.close()
        if d:
            d.session.close()
        if learner is not None:
            learner.forget(spec.request_id)
    end_s = time.perf_counter()
    first_s = first_s or end_s
    return SyncResult(tokens[: spec.max_new_tokens], pair, forwards, first_s - start_s, end_s - first_s, accept_lengths, trees)


def _commit(tokens: list[int], decided: Sequence[int], stops: Container[int]) -> int:
    """Append a verification's tokens to `tokens`, up to a stop token (that one included) -> how many it committed."""
    before = len(tokens)
    for token in decided:
        tokens.append(token)
        if token in stops:
            break
    return len(tokens) - before


def _teach(learner: CommitLearner, spec: RequestSpec, start: int, committed: Sequence[int], rows: torch.Tensor) -> None:
    """Give a STAND drafter what a pipeline's coordinator relays it: the tokens committed from `start`, with the
    target's top logprobs from their rows [>= len(committed), V]."""
    logprobs = token_logprobs(rows[: len(committed)], committed, spec.params, learner.learns_top)
    learner.learn(spec, Commit(spec.request_id, start, tuple(committed), logprobs))


def _check_target(target: Session) -> None:
    if not isinstance(target, DraftTreeSession):
        raise ValueError(f"draft trees need a target with tree forwards, which {type(target).__name__} lacks")


def _generate_tree(
    t: _Cursor,
    d: _Cursor,
    spec: RequestSpec,
    shape: TreeShape,
    method: TreeVerify,
    pair: PairStats,
    start_s: float,
    learner: CommitLearner | None,
) -> SyncResult:
    """The loop of `generate_sync` with draft trees: the drafter grows a tree a node a forward (pipespec.engine.
    tree_drafting.LineExpander), the target verifies it whole in one forward and keeps its accepted path; the
    drafter keeps what it fed of that path. A DREAM drafter gets the target's features of the path."""
    first_s = None
    tokens: list[int] = []
    accept_lengths: list[int] = []
    trees: list[DraftTree] = []
    params = spec.params
    features = isinstance(d.session, FeatureReader)
    try:
        _check_target(t.session)
        if features:
            hand_prefill(d.session, t.session, spec.request_id)
        while len(tokens) < spec.max_new_tokens and not (tokens and tokens[-1] in spec.stop_token_ids):
            start = len(tokens)
            most = spec.max_new_tokens - start - 1
            tree, line = DraftTree((), ()), None
            if most > 0:
                root = d.rows(tokens)[0]
                line = LineExpander(d.session, d.fed)
                tree = grow(root, line, shape, params, start, 1, most)
            t_rows = t.tree_rows(tokens, tree)  # [1 + nodes, V]
            decision = verify_tree(t_rows, tree, params, start, 0, method)
            trees.append(tree)
            if features:  # the target's hidden states of its own tokens and the accepted path
                kept = decision.on_path(t.session.hidden, root=t.fed_own - 1)  # [fed + accepted, H]
                d.session.add_features(step_message(spec.request_id, t.fed_from, kept, t.fed_own, decision.accepted))
            t.keep_path(decision.path)
            d.fed += line.kept(decision.tokens[:-1]) if line else 0  # the accepted path's start that its line holds
            pair.record(len(tree), decision.accepted)  # a tree's nodes are all drafts here (no line of the drafter's)
            accept_lengths.append(_commit(tokens, decision.tokens, spec.stop_token_ids))
            if learner is not None:
                _teach(learner, spec, start, tokens[start:], decision.on_path(t_rows))
            first_s = first_s or time.perf_counter()
    finally:
        t.session.close()
        d.session.close()
        if learner is not None:
            learner.forget(spec.request_id)
    end_s = time.perf_counter()
    first_s = first_s or end_s
    return SyncResult(
        tokens[: spec.max_new_tokens], pair, len(accept_lengths), first_s - start_s, end_s - first_s, accept_lengths, trees
    )
