"""What a STAND drafter remembers: per n-gram context, the target's distribution of the next token.

STAND (stochastic adaptive n-gram drafting) keeps, for every context of `min_n` to `max_n` tokens it has
seen the target commit after, the target's own probabilities of the next token there: its `top_k` likeliest
tokens, averaged over the times it saw that context (a token not among the target's top that time counts as 0;
a token the target gave no mass, as under its top-k or top-p, is never kept). Keeping the
probabilities, not only the token that came, is what lets it propose a token's runner-ups (draft trees) and
ship an honest q under rejection sampling. One memory serves every request of its stage, so what one answer
taught helps the next (STAND's setting: many samples of one prompt).

The memory is bounded: past `max_contexts` contexts it forgets the least recently taught (a context costs about
a kilobyte of Python objects at `top_k` 8). It is written on the stage's event loop (commits) and read on its
compute thread (forwards), under one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Seen:
    """One context's running sum of the target's top probabilities (normalised, their average)."""

    sums: dict[int, float] = field(default_factory=dict)


class NgramMemory:
    def __init__(self, min_n: int, max_n: int, top_k: int, max_contexts: int):
        self.min_n, self.max_n, self.top_k, self.max_contexts = min_n, max_n, top_k, max_contexts
        self._seen: OrderedDict[tuple[int, ...], _Seen] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def teach(self, context: Sequence[int], top: Sequence[tuple[int, float]]) -> None:
        """After `context`, the target's next-token probabilities were `top` ((token, probability), any order;
        the tokens not named count as 0): remembered under each of its last min_n .. max_n tokens."""
        top = [(token, p) for token, p in top if p > 0]  # a token it gave no mass is no proposal
        if not top:
            return
        with self._lock:
            for n in range(self.min_n, min(self.max_n, len(context)) + 1):
                key = tuple(context[-n:])
                seen = self._seen.pop(key, None) or _Seen()
                self._seen[key] = seen  # the most recently taught last
                for token, p in top:
                    seen.sums[token] = seen.sums.get(token, 0.0) + p
                if len(seen.sums) > 2 * self.top_k:  # keep the likeliest: the rest only ever lose rank
                    kept = sorted(seen.sums.items(), key=lambda item: -item[1])[: self.top_k]
                    seen.sums = dict(kept)
            while len(self._seen) > self.max_contexts:
                self._seen.popitem(last=False)

    def recall(self, context: Sequence[int]) -> list[tuple[int, float]] | None:
        """The distribution taught after the longest known suffix of `context`: its `top_k` likeliest (token,
        probability), likeliest first, summing to 1; None if no suffix of min_n .. max_n tokens was taught."""
        with self._lock:
            for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
                seen = self._seen.get(tuple(context[-n:]))
                if seen is not None:
                    top = sorted(seen.sums.items(), key=lambda item: (-item[1], item[0]))[: self.top_k]
                    break
            else:
                return None
        total = sum(p for _, p in top)  # > 0: only positive probabilities are kept
        return [(token, p / total) for token, p in top]
