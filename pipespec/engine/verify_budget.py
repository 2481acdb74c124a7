"""How many of its pending drafts each request of a verification checks: as many as pay for their rows.

A batched verifier (pipespec.engine.stage.BatchingStage) computes a row for every draft it checks, and as
batches grow those rows cost real time: a draft after a rejected one is a row for nothing. A request that
verifies g drafts, each accepted with probability a (its measured acceptance), yields

    E(g) = 1 + a + ... + a^g

tokens; a batched forward of n requests and R rows lasts T(n, R), fitted to the stage's own forwards
(`ForwardCosts`: what a request costs, its own attention over its own cache, apart from what a row costs).
`verify_counts` picks every request's g so that the forward yields the most expected tokens per second (the
"goodput" rule of SmartSpec, Liu et al. 2024): the k-th draft of a request adds a^k tokens, so the forward
takes the best prefix of all requests' drafts ranked by that gain. Rows a bucket pads anyway are free, so
every draft rides while the batch fits its bucket; where every row costs and acceptance is low, none does
and the verifier generates alone: speculation stops where it stops paying. Drafts left out stay pending
(the next forward may take them), and a verifier's tokens do not depend on how many drafts it checks, so
the answer is the same whatever is chosen (its distribution, under rejection sampling). Now and then (`EXPLORE_EVERY` batched verifications) every draft
rides, so that the fit keeps seeing forwards of every width: were rows measured too dear by chance, drafts
would otherwise never ride again, and the fit never be corrected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipespec.protocol.stats import PairStats

EXPLORE_EVERY = 16  # batched verifications: one in this many checks every pending draft
_PRIOR = 2.0  # weight, in verifications, of the stage's acceptance in a request's own estimate
_MOST = 0.999  # the acceptance no estimate exceeds: E(g) stays finite and each further draft gains less


class ForwardCosts:
    """A device's seconds per batched forward, fitted to its last `keep` forwards by least squares:

        T(n, R) = fixed + per_request * n + per_row * R     (n requests, R rows: its row bucket, the rows it pads to)

    A request's rows share its attention over its own cache, so a draft row costs less than a request does; the fit
    keeps the two apart. A shape's first forward is left out (it warms up: compiles, allocates); so are forwards far
    slower than the fit says (preempted on a shared machine), and no coefficient is below zero. The fit is made again
    after every `_REFIT_EVERY` forwards, not after each (it runs on the event loop: about 0.2 ms a fit)."""

    def __init__(self, keep: int = 64):
        self.keep = keep
        self._warmed: set[tuple[int, int]] = set()  # shapes (requests, rows) whose first forward was seen
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=keep)  # (requests, rows, seconds)
        self._fit: tuple[float, float, float] | None = None  # (fixed, per_request, per_row), made when needed
        self._unfitted = 0  # forwards measured since the fit was made

    @property
    def measured(self) -> bool:
        return len(self._recent) >= _LEAST_FORWARDS

    def observe(self, requests: int, rows: int, seconds: float) -> None:
        if (requests, rows) not in self._warmed:
            self._warmed.add((requests, rows))
            return
        self._recent.append((requests, rows, seconds))
        self._unfitted += 1

    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed, per_request, per_row) seconds, as fitted; None before enough forwards were measured."""
        if not self.measured:
            return None
        if self._fit is None or self._unfitted >= _REFIT_EVERY:
            self._unfitted = 0
            x = np.array([(1.0, n, r) for n, r, _ in self._recent])  # [forwards, 3]
            y = np.array([t for _, _, t in self._recent])  # [forwards]
            used = _identified(x)
            fit = np.zeros(3)
            fit[used] = _nonnegative_fit(x[:, used], y)
            residual = y - x @ fit
            typical = float(np.median(np.abs(residual)))
            kept = residual <= _OUTLIER * typical + 1e-9  # preempted forwards out (the fit's own, once)
            if kept.sum() >= 3 and (used == _identified(x[kept])).all():
                fit[used] = _nonnegative_fit(x[kept][:, used], y[kept])
            self._fit = (float(fit[0]), float(fit[1]), float(fit[2]))
        return self._fit

    def estimate(self, requests: int, rows: int) -> float | None:
        """Seconds of a forward of `requests` requests and `rows` rows; None before enough were measured."""
        fit = self.coefficients()
        return None if fit is None else fit[0] + fit[1] * requests + fit[2] * rows


_LEAST_FORWARDS = 8  # measured before the fit is trusted
_REFIT_EVERY = 8  # forwards measured between two fits
_OUTLIER = 3.0  # a forward slower than the fit by this many typical residuals is left out


def _identified(x: np.ndarray) -> np.ndarray:
    """The columns of x ([forwards, (1, requests, rows)]) the forwards can tell apart. Where the rows never varied
    apart from the requests (one shape, or rows in step with requests) a row's own cost is not seen, and is taken
    as none (optimistic: drafts then ride, and the forwards they widen are measured); where every forward carried
    as many requests, a request's is not seen (nor needed: the budget weighs rows at a given count)."""
    if np.linalg.matrix_rank(x) == 3:
        return np.array([True, True, True])
    if np.linalg.matrix_rank(x[:, [0, 1]]) == 2:
        return np.array([True, True, False])
    if np.linalg.matrix_rank(x[:, [0, 2]]) == 2:
        return np.array([True, False, True])
    return np.array([True, False, False])


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of y ~ x @ c with no c below zero, approximately: the coefficients the plain fit makes
    negative are dropped and the rest refitted (three columns: a few passes at most)."""
    free = np.ones(x.shape[1], dtype=bool)
    while True:
        c = np.zeros(x.shape[1])
        c[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        if (c >= 0).all() or free.sum() == 1:
            return np.maximum(c, 0.0)
        free &= c > 0


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
