"""One forward of one stage: its plan, made on the event loop, and what the compute thread makes of it.

A request's protocol plans a step from its state (pipespec.engine.request_protocol): the context tokens to keep in the
cache, its own unfed tokens, the drafts to verify (with their q rows under rejection sampling) and
the target features to apply first (a DREAM stage). `compute` runs a plan on the device's compute
thread (pipespec.engine.scheduler; `compute_batch`: several requests' plans as one forward of a stage that
batches): one forward, then the choice at every position (pipespec.engine.choice), timed
for the trace (pipespec.engine.trace); an error is caught and returned, so it fails only its own request.
The target of a request that asks for logprobs computes them here, from the same rows it decided on
(pipespec.engine.sampling.token_logprobs); no other stage does.
Tensors that leave the stage (q rows, hidden states for a DREAM drafter) are copied to the CPU here,
not on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property

import torch

from pipespec.engine.choice import Decision, decide, generate_each
from pipespec.engine.draft_tree import DraftTree
from pipespec.engine.outcome_cache import ALTERNATIVES, Branch, Doubt
from pipespec.engine.sampling import token_logprobs
from pipespec.engine.stage import BatchingStage, ChunkedPrefillStage, Feed, PrefillingSession, Session, Stage, TreeNodes
from pipespec.engine.trace import Timing
from pipespec.engine.tree_drafting import line_tree, siblings
from pipespec.engine.tree_verification import verify_tree
from pipespec.protocol.messages import RequestSpec, Siblings, TargetFeatures
from pipespec.protocol.tree_shape import TreeShape


@dataclass(frozen=True)
class StepPlan:
    request_id: str
    rev: int
    up_epoch: int
    keep: int  # context tokens to keep in the cache
    feed: tuple[int, ...]  # our own tokens to feed first (at least the last unfed one)
    start: int  # position of the first decided token (= len(tokens) at launch)
    drafts: tuple[int, ...]
    draft_probs: torch.Tensor | None  # [len(drafts), V]
    features: tuple[TargetFeatures, ...] = ()  # applied to the session before the forward (taken at launch)
    doubts: bool = False  # also rank each decided position: our likeliest other tokens there (pipespec.engine.outcome_cache)
    branch: Branch | None = None  # a forward of this pre-drafted branch, not of the main line
    riders: tuple[Rider, ...] = ()  # branches grown one token each in the same (tree) forward
    offers: TreeShape | None = None  # we offer trees: find our decided tokens' siblings (pipespec.engine.tree_drafting)
    siblings: tuple[Siblings | None, ...] = ()  # per draft, what our drafter offered beside it (a tree to check)
    room: int = 0  # most of those siblings the tree takes

    @cached_property
    def tree(self) -> DraftTree | None:
        """The drafts and the best of their siblings as one tree, when our drafter offered any (made once a plan:
        its rows, its forward and its outcome all read it)."""
        if self.room <= 0 or not any(s is not None and s.tokens for s in self.siblings):
            return None  # none offered beside the drafts (or no room): their line, as a chain
        return line_tree(self.drafts, self.siblings, self.room)

    @property
    def drafted(self) -> int:
        """The rows its drafts take: the line, or the tree's nodes (the line and the siblings it takes)."""
        tree = self.tree
        return len(self.drafts) if tree is None else len(tree)

    @property
    def rows(self) -> int:
        """The rows its forward computes: its own tokens, its drafts (and their siblings), its riders' lines."""
        return len(self.feed) + self.drafted + sum(len(rider.feed) for rider in self.riders)

    def verifying(self, n: int) -> StepPlan:
        """This step checking only its first `n` drafts (the rest stay pending: pipespec.engine.verify_budget)."""
        probs = self.draft_probs[:n] if self.draft_probs is not None and n else None
        return replace(self, drafts=self.drafts[:n], draft_probs=probs, siblings=self.siblings[:n])


@dataclass(frozen=True)
class Rider:
    """A pre-drafted branch fed beside a step's line in one tree forward (pipespec.engine.stage.TreeSession)."""

    branch: Branch
    base: int  # context tokens of the cache the branch's line shares (<= the step's keep)
    feed: tuple[int, ...]  # the branch's line after them
    start: int  # position of the token its forward decides


@dataclass(frozen=True)
class Prefill:
    """Open a request on the stage: prefill its prompt (pipespec.engine.stage), or on a stage whose prompts go in by
    chunks (`ChunkedPrefillStage`), begin it: its prompt's chunks are `PromptChunk`s."""

    request_id: str


@dataclass(frozen=True)
class PromptChunk:
    """Feed the next chunk of a begun request's prompt (pipespec.engine.stage.ChunkedPrefillStage)."""

    request_id: str


@dataclass(frozen=True)
class Outcome:
    """What the compute thread made of one plan: a result or the error it raised, and when (pipespec.engine.trace).

    result: the Session (a prefill; a prompt chunk's: once its prompt is in, else None), or (decision, our hidden states [F + n, H] when our drafter reads
    them, else None, one decision per rider) (a step)."""

    result: object
    error: BaseException | None
    planned: float
    timing: Timing


def compute(
    stage: Stage,
    plan: StepPlan | Prefill,
    session: Session | None,
    spec: RequestSpec,
    depth: int,
    sends_features: bool,
    planned: float,
) -> Outcome:
    """Compute thread: one plan, timed; its error is caught and returned."""
    started = time.perf_counter()
    try:
        if isinstance(plan, Prefill):
            result, timing = Timing.around(_open, stage, spec, sends_features)
        else:
            result, timing = Timing.around(_step, plan, session, spec, depth, sends_features)
    except Exception as error:
        return Outcome(None, error, planned, Timing(started, time.perf_counter(), 0.0))
    return Outcome(result, None, planned, timing)


def compute_batch(
    stage: BatchingStage,
    work: Sequence[tuple[StepPlan, Session, RequestSpec]],
    depth: int,
    sends_features: bool,
    planned: float,
) -> list[Outcome]:
    """Compute thread: several requests' steps as one forward of the stage's device (`forward_batch`); each
    outcome timed as that whole forward (the seconds each request waited for it, the forward's CPU seconds).
    A plan's error is its outcome's: when the batched forward fails, each request's forward runs alone (what a
    batch's requests feed is the same again: the caches are rewound to each one's keep), so one bad request
    fails alone."""
    started, cpu = time.perf_counter(), time.thread_time()
    errors: dict[int, BaseException] = {}
    feeds: dict[int, Feed] = {}
    for i, (plan, session, _) in enumerate(work):
        try:
            feeds[i] = _feed(plan, session)
        except Exception as error:
            errors[i] = error
    results: dict[int, object] = {}
    try:
        rows = stage.forward_batch(list(feeds.values())) if feeds else []
    except Exception:  # one request's (a context past a drafter's limit) or the device's: each tries alone, its error its own
        rows = []
        for i, feed in list(feeds.items()):
            try:
                rows.append(stage.forward_batch([feed])[0])
            except Exception as error:
                errors[i] = error
                del feeds[i]
    for i, (logits, side_rows) in zip(feeds, rows, strict=True):
        plan, session, spec = work[i]
        try:
            results[i] = _conclude(plan, session, spec, depth, sends_features, logits, side_rows)
        except Exception as error:
            errors[i] = error
    timing = Timing(started, time.perf_counter(), time.thread_time() - cpu)
    return [Outcome(results.get(i), errors.get(i), planned, timing) for i in range(len(work))]


def compute_chunks(
    stage: ChunkedPrefillStage, sessions: Sequence[PrefillingSession], sends_features: bool, planned: float
) -> list[Outcome]:
    """Compute thread: the next prompt chunk of each session, one forward (`prefill_batch`), timed as that forward.
    When it fails each session's chunk runs alone, so one bad request fails alone."""
    started, cpu = time.perf_counter(), time.thread_time()
    errors: dict[int, BaseException] = {}
    try:
        stage.prefill_batch(sessions)
    except Exception:
        for i, session in enumerate(sessions):
            try:
                stage.prefill_batch([session])
            except Exception as error:
                errors[i] = error
    timing = Timing(started, time.perf_counter(), time.thread_time() - cpu)
    outcomes = []
    for i, session in enumerate(sessions):
        if i in errors:
            outcomes.append(Outcome(None, errors[i], planned, timing))
            continue
        try:
            outcomes.append(Outcome(None if session.unfed_prompt else _ready(session, sends_features), None, planned, timing))
        except Exception as error:
            outcomes.append(Outcome(None, error, planned, timing))
    return outcomes


def _open(stage: Stage, spec: RequestSpec, sends_features: bool) -> Session:
    """Prefill (begin, where prompts go in by chunks); a session whose prompt is in is made ready (`_ready`)."""
    if isinstance(stage, ChunkedPrefillStage):
        session = stage.begin(spec)
        return _ready(session, sends_features) if not session.unfed_prompt else session
    return _ready(stage.open(spec), sends_features)


def _ready(session: Session, sends_features: bool) -> Session:
    """A target whose DREAM drafter reads its features hands over the prompt's, on the CPU."""
    if sends_features:  # the prompt's features leave the device here
        features = session.prefill_features
        moved = {f.name: getattr(features, f.name).cpu() for f in fields(features) if getattr(features, f.name) is not None}
        session.prefill_features = replace(features, **moved)
    return session


def _step(
    plan: StepPlan, session: Session, spec: RequestSpec, depth: int, sends_features: bool
) -> tuple[Decision, torch.Tensor | None, tuple[Decision, ...]]:
    """One forward over our unfed tokens and the drafts (and the riders' lines), then decide."""
    feed = _feed(plan, session)
    side_rows = None
    if feed.nodes is not None:
        logits = session.forward_nodes(feed.keep, feed.tokens, feed.nodes)  # [F + nodes, V]
    elif feed.sides:
        logits, side_rows = session.forward_tree(feed.keep, feed.tokens, feed.sides)  # [F + n, V], [R, V]
    else:
        logits = session.forward(feed.keep, feed.tokens)  # [F + n, V]
    return _conclude(plan, session, spec, depth, sends_features, logits, side_rows)


def _feed(plan: StepPlan, session: Session) -> Feed:
    """The target features applied to the session first; -> what its forward feeds: our unfed tokens and the drafts
    (as a tree's nodes, with their siblings, when our drafter offered them)."""
    for features in plan.features:
        session.add_features(features)
    tree = plan.tree
    if tree is not None:
        return Feed(session, plan.keep, plan.feed, nodes=TreeNodes(tree, tuple(range(len(tree)))))
    return Feed(session, plan.keep, plan.feed + plan.drafts, tuple((r.base, r.feed) for r in plan.riders))


def _conclude(
    plan: StepPlan,
    session: Session,
    spec: RequestSpec,
    depth: int,
    sends_features: bool,
    logits: torch.Tensor,  # [F + n, V]
    side_rows: torch.Tensor | None,  # [R, V]: the riders' (None: none)
) -> tuple[Decision, torch.Tensor | None, tuple[Decision, ...]]:
    """Decide at every position of the forward's rows (the target: and the logprobs asked for); grow each rider."""
    grown = ()
    if plan.riders:
        grown = tuple(map(_cpu, generate_each(side_rows, [r.start for r in plan.riders], spec.params, depth)))
    rows = logits[len(plan.feed) - 1 :]  # [n + 1, V]: positions start .. start + n (a tree: the root's, then each node's)
    hidden = session.hidden.cpu() if sends_features else None  # [F + n, H]
    tree = plan.tree
    if tree is None:
        decision = _cpu(decide(rows, plan.drafts, plan.draft_probs, spec.params, plan.start, depth))
        decided = rows[: len(decision.tokens)]  # the rows of the tokens decided
    else:
        decision, decided, hidden = _take_path(plan, session, spec, depth, tree, rows, hidden)
    if plan.doubts:
        decision = replace(decision, doubts=_doubts(decided, decision.tokens))
    if plan.offers is not None:
        decision = replace(decision, siblings=siblings(decided, decision.tokens, spec.params, plan.start, plan.offers))
    if depth == 0 and spec.logprobs is not None:  # rows of the tokens decided: positions start .. start + accepted
        decision = replace(decision, logprobs=token_logprobs(decided, decision.tokens, spec.params, spec.logprobs))
    return decision, hidden, grown


def _take_path(
    plan: StepPlan,
    session: Session,
    spec: RequestSpec,
    depth: int,
    tree: DraftTree,
    rows: torch.Tensor,  # [1 + nodes, V]: the root's, then each node's
    hidden: torch.Tensor | None,  # [F + nodes, H]
) -> tuple[Decision, torch.Tensor, torch.Tensor | None]:
    """A tree's decision (its path, kept in the session's cache) -> (the decision, the rows of the tokens decided,
    the hidden states of the fed tokens and the path)."""
    taken = verify_tree(rows, tree, spec.params, plan.start, depth)
    session.keep_path(plan.keep + len(plan.feed), taken.path)
    line = next((i for i, node in enumerate(taken.path) if node >= len(plan.drafts)), taken.accepted)
    decided = taken.on_path(rows)  # [accepted + 1, V]
    if hidden is not None:
        hidden = taken.on_path(hidden, root=len(plan.feed) - 1)  # [F + accepted, H]
    return Decision(taken.accepted, taken.tokens, None, agreed=line), decided, hidden


def _cpu(decision: Decision) -> Decision:
    """`decision` with its p' rows on the CPU (they leave the stage)."""
    return decision if decision.probs is None else replace(decision, probs=decision.probs.cpu())


def _doubts(rows: torch.Tensor, tokens: tuple[int, ...]) -> tuple[Doubt, ...]:
    """rows [n, V] of the decided tokens -> per token, our choice's probability and the likeliest others'."""
    probs = torch.softmax(rows.float(), dim=-1)  # [n, V]
    chosen = torch.tensor(tokens, device=rows.device)[:, None]  # [n, 1]
    chosen_p = probs.gather(1, chosen)[:, 0]  # [n]
    others = probs.scatter(1, chosen, -1.0).topk(min(ALTERNATIVES, probs.shape[1] - 1), dim=-1)  # [n, k], ours left out
    pairs = zip(others.indices.tolist(), others.values.tolist())
    return tuple(Doubt(c, tuple(zip(t, q))) for c, (t, q) in zip(chosen_p.tolist(), pairs))
