"""What one request's protocol keeps at one stage (pipespec.engine.request_protocol), split by role (design section 2).

Every stage holds its generated tokens (committed part + its own speculative tail) and the cache
bookkeeping over them (`RequestState`). Beside them, each role it plays has its own part:

- `VerifierSide`: as the verifier of its drafter (every stage but the first): the link's epoch, the
  drafts received but not yet verified, the pair's statistics and how long it waits for drafts;
- `DrafterSide`: as the drafter of its verifier, or for the target as the source of commits: what was
  sent downstream and what the verifier confirmed (which bounds the lookahead);
- `FeatureInbox`: a stage that reads its verifier's features (a DREAM drafter): those not yet applied.

Rejection sampling adds the processed distributions: ours per token (`RequestState.probs`, sent with
drafts) and the drafter's per pending draft (`VerifierSide.pending_probs`).

A request that asks for logprobs has the target hold those of its tokens not yet committed
(`RequestState.logprobs`, sent with the next Commit); the tokens a rejoin opens with were committed,
their logprobs sent, before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipespec.engine.outcome_cache import OutcomeCache
from pipespec.engine.stage import Session
from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.messages import RequestSpec, Siblings, TargetFeatures
from pipespec.protocol.stats import PairStats, StageStats

NOTHING_TOUCHED = 1 << 60


@dataclass
class VerifierSide:
    """The upstream link, seen from its verifier: the drafts at positions `start`.. not yet verified."""

    pair: PairStats
    epoch: int = 0
    pending: list[int] = field(default_factory=list)  # drafts at start..
    pending_probs: list[torch.Tensor | None] = field(default_factory=list)  # the drafter's q per draft (rejection)
    pending_siblings: list[Siblings | None] = field(default_factory=list)  # what it offered beside each (its `tree`)
    start: int = 0
    wait_until: float | None = None  # waiting for drafts (see pipespec.engine.patience) until then
    wait_for: int = 0  # ... or until this many are pending

    def drop_pending(self, n: int) -> None:
        """The first `n` pending drafts were dealt with."""
        del self.pending[:n], self.pending_probs[:n], self.pending_siblings[:n]
        self.start += n

    def clear_from(self, position: int) -> None:
        """No pending drafts; the next expected one is at `position`."""
        self.pending.clear()
        self.pending_probs.clear()
        self.pending_siblings.clear()
        self.start = position


@dataclass
class DrafterSide:
    """The downstream link, seen from its drafter (for the target: the link to the coordinator)."""

    epoch: int = 0
    sent: int = 0  # tokens sent downstream: drafts to the verifier, or commits to the coordinator
    verified: int = 0  # tokens the verifier has confirmed


@dataclass
class FeatureInbox:
    """A DREAM drafter's target features not yet applied to its session."""

    waiting: list[TargetFeatures] = field(default_factory=list)
    has_prefill: bool = False  # the prompt's features came: the drafter may step

    def add(self, message: TargetFeatures) -> None:
        self.waiting.append(message)
        self.has_prefill |= message.prefill is not None

    def take(self) -> tuple[TargetFeatures, ...]:
        taken, self.waiting = tuple(self.waiting), []
        return taken


@dataclass
class RequestState:
    """One request on one stage: its tokens and cache bookkeeping, and a part per role it plays."""

    spec: RequestSpec
    stats: StageStats
    up: VerifierSide | None  # None for the first stage (no drafter)
    features: FeatureInbox | None  # None unless the stage reads target features
    down: DrafterSide = field(default_factory=DrafterSide)
    session: Session | None = None  # None until prefill returns
    tokens: list[int] = field(default_factory=list)  # generated tokens: committed + speculative tail
    probs: list[torch.Tensor | None] = field(default_factory=list)  # our p' per token (rejection), None once verified
    probs_kept_from: int = 0  # probs before this position were freed (the verifier has them)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # the target's, of tokens[down.sent:] (if asked for)
    siblings: dict[int, Siblings] = field(default_factory=dict)  # by position, beside our tokens not yet verified (`tree`)
    fed: int = 0  # context tokens (prompt + generated) in the cache still valid for `tokens`
    rev: int = 0  # bumped whenever a verdict changes `tokens`
    touched: int = NOTHING_TOUCHED  # smallest position a verdict changed since the step in flight began
    outcomes: OutcomeCache | None = None  # branches pre-drafted for expected verdicts (a drafter that pre-drafts)
    tree: bool = False  # the session grows branches beside its steps (pipespec.engine.stage.TreeSession)

    @property
    def prompt_len(self) -> int:
        assert self.session is not None
        return self.session.prompt_len
