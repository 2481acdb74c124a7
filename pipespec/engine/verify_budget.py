"""How many of its pending drafts each request of a verification checks: as many as pay for their rows.

A batched verifier (pipespec.engine.stage.BatchingStage) computes a row for every draft it checks, and as
batches grow those rows cost real time: a draft after a rejected one is a row for nothing. A request that
verifies g drafts, each accepted with probability a (its measured acceptance), yields

    E(g) = 1 + a + ... + a^g

tokens; a forward of R rows lasts T(R), measured per row bucket on the stage's own device (`ForwardCosts`).
`verify_counts` picks every request's g so that the forward yields the most expected tokens per second (the
"goodput" rule of SmartSpec, Liu et al. 2024): the k-th draft of a request adds a^k tokens, so the forward
takes the best prefix of all requests' drafts ranked by that gain. Rows a bucket pads anyway are free, so
every draft rides while the batch fits its bucket; where every row costs and acceptance is low, none does
and the verifier generates alone: speculation stops where it stops paying. Drafts left out stay pending
(the next forward may take them), and a verifier's tokens do not depend on how many drafts it checks, so
the answer is the same whatever is chosen.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipespec.protocol.stats import PairStats

_PRIOR = 2.0  # weight, in verifications, of the stage's acceptance in a request's own estimate
_MOST = 0.999  # the acceptance no estimate exceeds: E(g) stays finite and each further draft gains less


class ForwardCosts:
    """A device's seconds per forward by the rows it computed (a row bucket), measured: an average per bucket.

    Rows never measured are estimated from their neighbours: between two, linearly; past the widest, along the
    slope of the two widest, never cheaper than the widest; below the least, cheaper in proportion to the rows.
    The last is optimistic on purpose: a narrower forward than any run so far gets chosen, and so measured (were
    it as dear as the least measured, the wide forwards the first batches ran would never be narrowed)."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}  # rows -> moving average of a forward's seconds
        self._rows: list[int] = []  # the measured rows, ascending

    def observe(self, rows: int, seconds: float) -> None:
        held = self.seconds.get(rows)
        if held is None:
            bisect.insort(self._rows, rows)
        self.seconds[rows] = seconds if held is None else (1 - self.smoothing) * held + self.smoothing * seconds

    def estimate(self, rows: int) -> float | None:
        """Seconds of a forward of `rows` rows; None before any forward was measured."""
        if rows in self.seconds or not self.seconds:
            return self.seconds.get(rows)
        i = bisect.bisect(self._rows, rows)
        if i == 0:
            least = self._rows[0]
            return self.seconds[least] * rows / least
        if len(self._rows) == 1:
            return self.seconds[self._rows[0]]
        i = min(i, len(self._rows) - 1)  # past the widest: the two widest's slope
        below, above = self._rows[i - 1], self._rows[i]
        low, high = self.seconds[below], self.seconds[above]
        slope = (high - low) / (above - below)
        return low + slope * (rows - below) if rows < above else high + max(slope, 0.0) * (rows - above)


@dataclass(frozen=True)
class Candidate:
    """One request of a verification: the rows it feeds besides drafts, its pending drafts, its acceptance."""

    rows: int
    drafts: int
    acceptance: float


def acceptance(pair: PairStats, prior: float) -> float:
    """A request's chance that its verifier accepts its next draft: its own record, `prior` (the stage's rate)
    weighted as two verifications before it has one."""
    accepted, rejected = pair.num_accepted_tokens, pair.num_rejections
    return min((accepted + _PRIOR * prior) / (accepted + rejected + _PRIOR), _MOST)


def verify_counts(candidates: Sequence[Candidate], cost: Callable[[int], float | None]) -> list[int]:
    """-> per candidate, how many of its drafts the forward verifies: the most expected tokens per second of the
    forward, `cost(rows)` its seconds (None: not measured yet, so every draft rides)."""
    ranked = sorted(
        ((c.acceptance**k, k, i) for i, c in enumerate(candidates) for k in range(1, c.drafts + 1)),
        key=lambda gain: (-gain[0], gain[1]),
    )  # a request's k-th draft after its (k-1)-th: its gains fall with k
    rows = sum(c.rows for c in candidates)
    expected = float(len(candidates))  # each request's own token
    best, best_rate = 0, 0.0
    for m in range(len(ranked) + 1):  # the first m ranked drafts ride
        if m:
            expected += ranked[m - 1][0]
        seconds = cost(rows + m)
        if seconds is None:
            return [c.drafts for c in candidates]
        rate = expected / max(seconds, 1e-9)
        if rate >= best_rate:  # ties: the more drafts (a padded bucket's rows are free)
            best, best_rate = m, rate
    counts = [0] * len(candidates)
    for _, _, i in ranked[:best]:
        counts[i] += 1
    return counts
