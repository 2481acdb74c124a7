"""A compiled forward replayed from CUDA graphs captured by hand: one graph per KV cache and width.

torch.compile's own CUDA graphs (its "reduce-overhead" mode, cudagraph trees) bind a compiled function to
the graph manager of the thread that first called it, the thread that built the stage, and that manager is
not thread-safe: with stages serving from threads of their own it corrupts memory. The graph a call needs is known here anyway: the request's cache and
the forward's width name it. So `GraphedStep` captures the compiled step once per (cache, width), with its
own buffers for the token ids and positions, and a call copies those two small tensors in and replays
(experiments/results/device/README.md has what a replay costs).

What makes it sound: a stage's caches come from its pool (pipespec.stages.kv_pool) and are never freed,
so the addresses a graph writes stay valid, and each graph keeps its cache alive; the cache's length is a
tensor the graph reads and advances, set before each replay (`StaticKV.rewind`); every graph of a stage
shares one memory pool, so a replay overwrites the outputs of the one before, which the caller copies out
first (pipespec.stages.forwards runs replays one at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipespec.stages.kv_pool import RequestCache

# One forward at a fixed width: (cache, ids [1, w], cache positions [w]) -> outputs [1, w, ...] each.
Step = Callable[[RequestCache, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class _Captured:
    """One captured forward: it reads `ids` [1, w] and `positions` [w], writes `cache`, leaves `outputs`."""

    cache: RequestCache
    ids: torch.Tensor
    positions: torch.Tensor
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, step: Step, cache: RequestCache, ids: torch.Tensor, positions: torch.Tensor, pool: tuple) -> _Captured:
        """Capture `step` at this call's inputs. It runs twice first, on a side stream (compiling on its
        first call, as CUDA graph capture requires), writing where the captured forward will write next.
        All of it on the cache's GPU, which need not be the compute thread's current one (`cuda:N` stages)."""
        ids, positions = ids.clone(), positions.clone()
        at = cache.length
        with torch.cuda.device(ids.device):
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(2):
                    cache.rewind(at)
                    step(cache, ids, positions)
            main.wait_stream(side)
            cache.rewind(at)
            graph = torch.cuda.CUDAGraph()
            # on a stream of this GPU (torch's default capture stream is made once, on the GPU current then);
            # other stages' threads go on meanwhile
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                outputs = step(cache, ids, positions)
            main.wait_stream(side)
        return cls(cache, ids, positions, graph, tuple(outputs))

    def replay(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.cuda.device(self.ids.device):
            self.ids.copy_(ids)
            self.positions.copy_(positions)
            self.graph.replay()
        return self.outputs


class GraphedStep:
    """`step`, called as it is, replayed from the graph of its cache and width (captured at their first call)."""

    def __init__(self, step: Step):
        self.step = step
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def captured(self) -> int:
        """Graphs captured so far: one per cache and width used."""
        return len(self._graphs)

    def __call__(self, cache: RequestCache, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = (id(cache), ids.shape[1])  # a captured graph holds its cache: the id is never reused
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = _Captured.of(self.step, cache, ids, positions, self._pool)
        return captured.replay(ids, positions)
