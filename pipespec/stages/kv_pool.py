"""A stage's KV caches: sized to what a request can use, admitted within the stage's budget, kept for reuse.

A request's cache holds `size` context positions: what it can use (its prompt, its `max_new_tokens` and a
forward's padding) rounded up to a multiple of `SIZE_STEP`, at most the stage's capacity (`size_for`).
Rounding to 512 keeps a request's logits what they are with the whole capacity: attention reads a cache's
keys in blocks of 512 on this CPU (torch 2.13's flash attention), and a block past every query's position
adds nothing, so a request attends over the same blocks at any size its length allows (measured: 800 of
800 draws bitwise equal at capacities 520 to 4104, fp32 and bf16, one and two threads:
experiments/results/batch_invariance/README.md; tests/test_kv_pool.py checks it). A short request on a 4096-token stage so holds and
reads 512 positions, not 4104.

The stage's budget (`kv_budget_gib`, bytes here) bounds the caches requests hold: `admits` says whether
one more of a size fits now (a request that does not waits for one to close, pipespec.engine.runner), and a
request whose cache alone is over the budget is refused when it opens. Closed requests' caches stay for
the next ones of their size: on a GPU the compiled forwards replay CUDA graphs captured per cache
(pipespec.stages.cuda_graphs), which read and write the addresses they were captured with, so each cache
is captured once and replayed for every request that holds it afterwards. Idle caches of other sizes are
dropped when a new one would take the pool past the budget (on a GPU a dropped cache's graphs keep it
alive: there the budget bounds the caches requests hold, not the memory the pool's graphs keep).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

SIZE_STEP = 512  # a cache's positions: a multiple of this (see above), or the stage's capacity


class RequestCache(Protocol):
    """One request's cache, as a stage's forwards feed it: the first `length` context positions held
    (a `StaticKV`, a DREAM stage's `DraftState`); `rewind` keeps the positions before a point."""

    @property
    def length(self) -> int: ...

    def rewind(self, length: int) -> None: ...


Cache = TypeVar("Cache", bound=RequestCache)


class KVPool(Generic[Cache]):
    """A stage's caches of at most `capacity` positions: `take` one of a size for a request (an idle one, else a
    new one from `new`), `give` it back when it closes; `admits` one more within `budget` bytes (None: no
    bound), `bytes_for` a size."""

    def __init__(self, new: Callable[[int], Cache], bytes_for: Callable[[int], int], capacity: int, budget: int | None = None):
        self._new = new
        self.bytes_for = bytes_for
        self.capacity = capacity
        self.budget = budget
        self._idle: dict[int, list[Cache]] = {}
        self._sizes: dict[int, int] = {}  # id(cache) -> its size, for every cache the pool made and still keeps
        self._lock = threading.Lock()
        self.in_use = 0  # bytes of the caches requests hold
        self.made = 0  # caches this pool has allocated

    @property
    def held(self) -> int:
        """Bytes of every cache the pool keeps, idle ones included."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        """`held`, the lock already taken."""
        return sum(self.bytes_for(size) for size in self._sizes.values())

    def size_for(self, positions: int) -> int:
        """The cache size of a request that can use `positions` context positions."""
        return min(self.capacity, -(-positions // SIZE_STEP) * SIZE_STEP)

    def admits(self, size: int) -> bool:
        """Whether a request's cache of `size` fits the budget now (always when no request holds one, and when it
        never could: its `open` then refuses it, naming the budget, instead of its waiting for good)."""
        need = self.bytes_for(size)
        with self._lock:
            return self.budget is None or self.in_use == 0 or need > self.budget or self.in_use + need <= self.budget

    def check(self, stage: str, size: int) -> None:
        """A ValueError naming the budget if a cache of `size` alone is over it: such a request could never run."""
        if self.budget is not None and self.bytes_for(size) > self.budget:
            raise ValueError(
                f"stage {stage!r}: a request's KV cache of {size} positions takes {self.bytes_for(size) / 2**20:.1f} MiB, "
                f"more than the stage's kv_budget_gib of {self.budget / 2**30:g} GiB"
            )

    @property
    def use(self) -> float:
        """The share of the budget requests hold now (0 without a budget)."""
        return self.in_use / self.budget if self.budget else 0.0

    def take(self, size: int) -> Cache:
        """An empty cache of `size` positions that no other request holds."""
        need = self.bytes_for(size)
        with self._lock:
            idle = self._idle.get(size)
            cache = idle.pop() if idle else None
            if cache is None and self.budget is not None:
                self._drop_idle(need)
            self.in_use += need
        if cache is None:
            try:
                cache = self._new(size)
            except BaseException:
                with self._lock:
                    self.in_use -= need
                raise
            with self._lock:
                self._sizes[id(cache)] = size
                self.made += 1
        cache.rewind(0)
        return cache

    def give(self, cache: Cache) -> None:
        """Take `cache` back: its request is done with it."""
        with self._lock:
            size = self._sizes[id(cache)]
            idle = self._idle.setdefault(size, [])
            if any(c is cache for c in idle):
                raise RuntimeError("a KV cache was given back twice: two requests would share it")
            idle.append(cache)
            self.in_use -= self.bytes_for(size)

    def _drop_idle(self, need: int) -> None:
        """Drop idle caches, the largest first, until `need` more bytes fit the budget (or none is left). Locked."""
        held = self._held()
        for size in sorted(self._idle, reverse=True):
            idle = self._idle[size]
            while idle and held + need > self.budget:
                del self._sizes[id(idle.pop())]
                held -= self.bytes_for(size)
