"""A stage's KV caches, kept for reuse: a closed request's cache serves the next one.

On a GPU the compiled forwards replay CUDA graphs captured per cache and width (pipespec.stages.cuda_graphs),
and a graph reads and writes its cache at the addresses it was captured with. A cache allocated per request
would need a capture per request. So a stage keeps the caches of closed requests and hands them to the next
ones: each cache is captured once per width, and replayed for every request that holds it afterwards. The
pool grows to the stage's peak of requests in flight and keeps that many caches (each `capacity` x layers x
KV heads). On a CPU reuse only saves the allocation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class RequestCache(Protocol):
    """One request's cache, as a stage's forwards feed it: the first `length` context positions held
    (a `StaticKV`, a DREAM stage's `DraftState`); `rewind` keeps the positions before a point."""

    @property
    def length(self) -> int: ...

    def rewind(self, length: int) -> None: ...


Cache = TypeVar("Cache", bound=RequestCache)


class KVPool(Generic[Cache]):
    """`take` a cache for a request (an idle one, else a new one from `new`), `give` it back when it closes."""

    def __init__(self, new: Callable[[], Cache]):
        self._new = new
        self._idle: list[Cache] = []
        self._lock = threading.Lock()
        self.made = 0  # caches this pool has allocated: its peak of requests in flight

    def take(self) -> Cache:
        """An empty cache that no other request holds."""
        with self._lock:
            cache = self._idle.pop() if self._idle else None
        if cache is None:
            cache = self._new()
            with self._lock:
                self.made += 1
        cache.rewind(0)
        return cache

    def give(self, cache: Cache) -> None:
        """Take `cache` back: its request is done with it."""
        with self._lock:
            if any(c is cache for c in self._idle):
                raise RuntimeError("a KV cache was given back twice: two requests would share it")
            self._idle.append(cache)
