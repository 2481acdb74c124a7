"""The role every stage kind plays: a model that can open a request and feed it tokens.

A `Session` is one request's model state on one stage: a KV cache (or its equivalent) over the
request's *context* = the stage's prompt tokens followed by the generated tokens. A stage's prompt is
its own view of the request's: text-only stages see `request.text_prompt` (no image tokens), an
image stage the full prompt; generated positions are the same for all. `Stage.open`
prefills all prompt tokens but the last, so that every later `forward` feeds at least one token and
returns the logits the runner needs; the runner never asks a stage for logits it has already thrown
away. `forward(keep, tokens)` truncates the cache to its first `keep` context tokens, feeds `tokens`
after them, and returns one row of logits per fed token (row i predicts the token after tokens[i]).
After every call `cache_len == keep + len(tokens)` holds, and stages assert it.

Stages run on the runner's compute thread, never on the event loop.

Optional capabilities are protocols of their own: a `TargetStage` tells the front door its context
limit and end-of-sequence tokens; a `TreeSession` grows side lines in the same forward (a drafter's
pre-drafted branches, pipespec.engine.outcome_cache); between a target and the DREAM drafter right
before it, the target's sessions are `FeatureSource`s and the drafter's `FeatureReader`s
(pipespec.engine.handoff); a `BatchingStage` runs the forwards of several requests as one device forward
(their runner then gathers every ready request's step into one batch, up to its `max_batch`); a
`ChunkedPrefillStage` feeds prompts in chunks, several requests' in one forward, between the steps; an
`AdmittingStage` opens a request only once its memory fits; a `CommitLearner` learns from what the target
commits. Which kind has which is said by the table of stage kinds (pipespec.schema.kinds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from pipespec.engine.draft_tree import DraftTree
from pipespec.protocol.messages import Commit, PrefillFeatures, RequestSpec, TargetFeatures


class Session(Protocol):
    prompt_len: int  # context tokens before generated position 0
    last_prompt_token: int  # the one prompt token `open` leaves for the first `forward`

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        """-> [len(tokens), V] float32 logits."""
        ...

    def close(self) -> None: ...


class Stage(Protocol):
    name: str
    vocab_size: int

    def open(self, request: RequestSpec) -> Session: ...


class TargetStage(Stage, Protocol):
    """A stage that can be the target: what the front door reads of it (pipespec.requests.frontdoor.TargetInfo)."""

    max_context: int | None  # most context tokens (prompt + generated); None: no limit
    eos_token_ids: frozenset[int]  # tokens that end a generation


@runtime_checkable
class TreeSession(Session, Protocol):
    """A session whose forward also feeds side lines at the cost of one forward: a tree (or small batch) of
    lines over one cache, as a GPU runs a few at the price of one. The mock stages have it (emulating that
    device); the Hugging Face stages do not yet (a tree attention mask over their cache: not built)."""

    def forward_tree(
        self, keep: int, tokens: Sequence[int], sides: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(keep, tokens)`, and for each side (base, side_tokens): the logits after the cache's first
        `base` context tokens (base <= keep) followed by side_tokens, which the cache does not keep.
        -> ([len(tokens), V], [len(sides), V]) float32 logits."""
        ...


@dataclass(frozen=True)
class TreeNodes:
    """Nodes of a draft tree (pipespec.engine.draft_tree) that a forward feeds after its line of tokens. Each node's
    row sits at the position after its parent's (the tree's root: the line's last token, or the cache's last if the
    line is empty) and attends to the cache before the tree and to its own ancestors only. Node i's keys go in
    past the cache's length (a model stage's: at keep + len(line) + a gap + i, pipespec.stages.packing.TreeRows),
    until `DraftTreeSession.keep_path` moves a path's into place."""

    tree: DraftTree
    fed: tuple[int, ...]  # the nodes fed now, parents first; an ancestor not among them was fed since the same keep


@runtime_checkable
class DraftTreeSession(Session, Protocol):
    """A session that feeds draft trees (the model and mock stages'): a verifier checks a whole tree in one forward
    (a drafter could grow one a level a forward; the synchronous engine's grows one a node a forward with `forward`,
    pipespec.engine.tree_drafting.LineExpander); each node's logits are bitwise those of a one-token decode of its path."""

    def forward_nodes(self, keep: int, line: Sequence[int], nodes: TreeNodes) -> torch.Tensor:
        """`forward(keep, line)` and the tree's nodes `nodes.fed` after it, in one forward; the cache then holds
        keep + len(line) entries (the nodes' past them). -> [len(line) + len(nodes.fed), V] float32 logits."""
        ...

    def keep_path(self, at: int, path: Sequence[int]) -> None:
        """After a tree forward that left `at` entries: the entries of the tree nodes `path` (root's child first,
        each fed) moved to at, at + 1, ..; the cache then holds at + len(path)."""
        ...


@dataclass(frozen=True)
class Feed:
    """One request's part of a batched forward: `session.forward(keep, tokens)`, and a tree session's side
    lines (`TreeSession.forward_tree`'s `sides`; none for other sessions), or the draft-tree nodes after its
    tokens (a `DraftTreeSession`'s)."""

    session: Session
    keep: int
    tokens: Sequence[int]
    sides: Sequence[tuple[int, Sequence[int]]] = ()
    nodes: TreeNodes | None = None


NO_SIDES = torch.empty(0)  # the side rows of a feed without side lines (a session that is not a TreeSession)


@runtime_checkable
class BatchingStage(Stage, Protocol):
    """A stage that runs the forwards of several requests as one forward of its device: the model stages pack
    their rows into one forward (pipespec.stages.packed_forwards), the mocks emulate it (the forward's latency
    once, its cost per token for every row of every request). Each request's logits are bitwise the ones it
    gets alone (a model stage's, wherever its forwards are at least 4 rows wide: pipespec.stages.packing)."""

    def forward_batch(self, feeds: Sequence[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """-> per feed, ([len(tokens), V], [len(sides), V]) float32 logits, as its session's forward gives them."""
        ...

    def forward_rows(self, rows: int) -> int:
        """The rows a forward carrying `rows` rows of requests computes: its row bucket (the rows it pads to)."""
        ...


@runtime_checkable
class PrefillingSession(Session, Protocol):
    """A session opened with its prompt still to feed (`ChunkedPrefillStage.begin`)."""

    unfed_prompt: int  # prompt tokens (all but the last) not yet in its cache; 0: it may step


@runtime_checkable
class ChunkedPrefillStage(BatchingStage, Protocol):
    """A stage whose prompts go in by chunks (the model stages'): `begin` opens a request with what comes before
    its language model done (an image encoded) and its prompt unfed; each `prefill_batch` feeds the sessions given
    their next chunk, at most `prefill_rows` tokens each, in one forward. The runner rides several requests' chunks
    in one forward and runs those forwards between the steps (pipespec.engine.runner), so a long prompt delays the
    streams by one chunk at a time, not by its whole prefill. Chunks start at multiples of `prefill_rows` in every
    request's prompt, whatever rides with them, so the cache a prompt leaves does not depend on its neighbours
    (a product's row depends on the row count only below 4 rows: pipespec.stages.packing). `open` is `begin`,
    then chunks until the prompt is in (`open_whole`)."""

    prefill_rows: int

    def begin(self, request: RequestSpec) -> PrefillingSession: ...

    def prefill_batch(self, sessions: Sequence[PrefillingSession]) -> None: ...


def open_whole(stage: ChunkedPrefillStage, request: RequestSpec) -> PrefillingSession:
    """`request` opened on `stage` with its whole prompt fed, one chunk a forward; a failure gives its cache back."""
    session = stage.begin(request)
    try:
        while session.unfed_prompt:
            stage.prefill_batch([session])
    except BaseException:
        session.close()
        raise
    return session


def chunk_of(stage: ChunkedPrefillStage, session: PrefillingSession) -> int:
    """The prompt tokens `session`'s next chunk feeds."""
    return min(stage.prefill_rows, session.unfed_prompt)


def next_chunk(stage: ChunkedPrefillStage, session: PrefillingSession) -> slice:
    """Where `session`'s next chunk lies in its prompt (of the tokens before the last: the first step feeds that)."""
    fed = session.prompt_len - 1 - session.unfed_prompt
    return slice(fed, fed + chunk_of(stage, session))


@runtime_checkable
class AdmittingStage(Stage, Protocol):
    """A stage with a memory budget (the model stages' KV caches, pipespec.stages.kv_pool): the runner opens a
    request on it only once it fits; until then the request waits (it does not fail)."""

    def admits(self, request: RequestSpec) -> bool: ...

    @property
    def kv_use(self) -> float:
        """The share of its budget that its requests hold now."""
        ...


@runtime_checkable
class CommitLearner(Stage, Protocol):
    """A stage that learns from what the target commits (a STAND drafter, pipespec.stages.stand): it is given every
    `Commit` of its requests, each token with the target's `learns_top` likeliest tokens at its position. `learn`
    and `forget` run on the event loop, beside the compute thread's forwards."""

    learns_top: int

    def learn(self, request: RequestSpec, commit: Commit) -> None:
        """`commit` continues what `request` committed so far (its `committed` tokens, then the commits learnt)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended: drop what was kept of it (never what was learnt)."""
        ...


@runtime_checkable
class FeatureSource(Session, Protocol):
    """A target's session that gives a DREAM drafter its features (the vlm stage's)."""

    prefill_features: PrefillFeatures | None  # the prompt's, after `open`; dropped once sent (pipespec.engine.request_protocol)
    hidden: torch.Tensor | None  # [n, H] last-layer post-norm hidden states of the n tokens the latest forward fed


@runtime_checkable
class FeatureReader(Session, Protocol):
    """A DREAM drafter's session: it reads its target's features (the prefill's first, then per verification)."""

    def add_features(self, features: TargetFeatures) -> None: ...


def unfed_tail(last_prompt_token: int, prompt_len: int, fed: int, tokens: Sequence[int]) -> tuple[int, ...]:
    """Context tokens a session holding `fed` of them still needs, generated `tokens` included.

    `open` prefills all prompt tokens but the last, and rollbacks never cut into the prompt, so the
    only prompt token ever missing is the last one; the last token is never fed before its step.
    """
    assert prompt_len - 1 <= fed < prompt_len + len(tokens), (fed, prompt_len, len(tokens))
    head = (last_prompt_token,) if fed < prompt_len else ()
    return head + tuple(tokens[max(fed - prompt_len, 0) :])


class KVLengthError(AssertionError):
    """The cache length invariant `cache_len == keep + fed` broke: a rollback bug, never user error."""


def check_keep(stage: str, keep: int, cache_len: int) -> None:
    if not 0 <= keep <= cache_len:
        raise KVLengthError(f"stage {stage!r}: asked to keep {keep} context tokens of a cache holding {cache_len}")


def check_length(stage: str, cache_len: int, expected: int) -> None:
    if cache_len != expected:
        raise KVLengthError(f"stage {stage!r}: cache holds {cache_len} tokens, expected {expected} (prompt + fed)")
