"""Per-request sampling parameters. Torch-free: the coordinator and clients import this."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

SEEDS = 2**64  # a seed is an integer in [0, SEEDS): the coupled noise keys on 64 bits (pipespec.engine.noise)


class VerifyMode(str, enum.Enum):
    """How a verifier decides on drafted tokens when temperature > 0 (greedy ignores it)."""

    COUPLED = "coupled"  # shared Gumbel noise: exact match, bit-reproducible
    REJECTION = "rejection"  # Leviathan et al.: accept with min(1, p/q), residual on rejection


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    verify: VerifyMode = VerifyMode.COUPLED

    def __post_init__(self) -> None:
        """The ranges, one home for them: config defaults and every request's overrides are checked here."""
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")
        if not 0 <= self.seed < SEEDS:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def rejection(self) -> bool:
        return not self.greedy and self.verify is VerifyMode.REJECTION
