"""Statistics, named like vLLM's spec-decode metrics.

`PairStats` is kept by a verifier about its drafter: how many verification steps saw drafts
(`num_drafts`), how many draft tokens it checked and accepted, and how often each draft index was
accepted. Mean acceptance length = 1 + accepted / drafts (the bonus or correction token counts 1): the tokens a
verification commits. With draft trees it also checks siblings beside the drafts: `num_nodes` counts every node
a verification checked (the drafts, and the siblings its tree took).
`merged_pairs` sums each pair's over several requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields


@dataclass
class PairStats:
    drafter: str
    verifier: str
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0  # verification steps that rejected a draft (the rest accepted all)
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps accepting draft index i
    num_nodes: int = 0  # draft-tree nodes checked: the drafts and their siblings (a chain: its drafts)

    def record(self, drafted: int, accepted: int, nodes: int | None = None, rejected: bool | None = None) -> None:
        """A verification of `drafted` drafts (in a tree of `nodes`, siblings included) that accepted `accepted` tokens
        and `rejected` a draft (default: it accepted fewer than all; a tree's path may leave the line at a sibling)."""
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_nodes += drafted if nodes is None else nodes
        self.num_accepted_tokens += accepted
        self.num_rejections += accepted < drafted if rejected is None else rejected
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: PairStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_nodes += other.num_nodes
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_rejections += other.num_rejections
        for i, c in enumerate(other.accepted_per_position):
            if i < len(self.accepted_per_position):
                self.accepted_per_position[i] += c
            else:
                self.accepted_per_position.append(c)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (vLLM's draft acceptance rate; depends on how many were drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def token_acceptance(self) -> float:
        """Per-token acceptance probability alpha of the analytical models: each drafted token is
        accepted with probability alpha until the first rejection (a truncated geometric law)."""
        trials = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / trials if trials else 0.0

    def per_position_acceptance(self) -> list[float]:
        return [c / self.num_drafts for c in self.accepted_per_position] if self.num_drafts else []

    def as_dict(self) -> dict:
        return {
            "drafter": self.drafter,
            "verifier": self.verifier,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_nodes": self.num_nodes,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_rejections": self.num_rejections,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance(),
        }


def merged_pairs(per_request: Iterable[Iterable[PairStats]]) -> list[PairStats]:
    """Each drafter -> verifier pair's statistics summed over requests (each request's pairs), in the
    order they first appear (pipeline order); the inputs are left as they were."""
    merged: dict[tuple[str, str], PairStats] = {}
    for pairs in per_request:
        for pair in pairs:
            key = (pair.drafter, pair.verifier)
            merged.setdefault(key, PairStats(*key)).merge(pair)
    return list(merged.values())


@dataclass
class StageStats:
    """What one stage did for one request."""

    stage: str
    forwards: int = 0  # model calls (prefill included)
    tokens_fed: int = 0  # tokens pushed through the model after prefill
    rollbacks: int = 0  # times a verdict truncated this stage's sequence
    dropped_drafts: int = 0  # stale-epoch drafts dropped on arrival
    compute_s: float = 0.0  # seconds inside the model and the choice function, the prefill included
    predraft_hits: int = 0  # verdicts that changed our tokens and a pre-drafted branch foresaw (pipespec.engine.outcome_cache)
    predraft_misses: int = 0  # ... that no branch foresaw (while pre-drafting is on)
    predraft_tokens: int = 0  # tokens sent from branches, without a forward
    predraft_forwards: int = 0  # forwards that grew branches, their own or beside our line (a tree forward; in `forwards`)
    relayed_drafts: int = 0  # drafts passed on to our verifier unchecked, under load (a middle stage's `relay_above`)
    kv_use: float = (
        0.0  # the share of the stage's KV budget its requests held when it finished this one (pipespec.stages.kv_pool)
    )

    def merge(self, other: StageStats) -> None:
        """Add `other`'s counts and seconds (the same stage's, for another request) to ours; `kv_use`: the larger."""
        if other.stage != self.stage:
            raise ValueError(f"cannot merge stage {other.stage!r}'s statistics into stage {self.stage!r}'s")
        for f in fields(self):
            if f.name == "kv_use":
                self.kv_use = max(self.kv_use, other.kv_use)
            elif f.name != "stage":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def predraft_hit_rate(self) -> float:
        """Of the verdicts that changed our tokens, the share a pre-drafted branch foresaw."""
        verdicts = self.predraft_hits + self.predraft_misses
        return self.predraft_hits / verdicts if verdicts else 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def merged_stages(per_request: Iterable[Iterable[StageStats]]) -> list[StageStats]:
    """Each stage's statistics summed over requests, in the order they first appear (pipeline order, unless a
    stage lost during the first request is missing from it); the inputs are left as they were."""
    merged: dict[str, StageStats] = {}
    for stages in per_request:
        for stage in stages:
            merged.setdefault(stage.stage, StageStats(stage.stage)).merge(stage)
    return list(merged.values())


@dataclass
class RequestStats:
    """End-to-end figures of one request, prefill apart from decode."""

    prompt_tokens: int
    generated_tokens: int
    prefill_s: float  # submission -> first committed token
    decode_s: float  # first committed token -> finish
    pairs: list[PairStats]
    stages: list[StageStats]

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "pairs": [p.as_dict() for p in self.pairs],
            "stages": [s.as_dict() for s in self.stages],
        }
