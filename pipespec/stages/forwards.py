"""The fixed shapes of a model stage's decode and verification forwards, and why; the DREAM stage's forwards.

(The Hugging Face stages, causal_lm and vlm, run theirs packed, many requests a forward, on the shapes
and the findings below: pipespec.stages.packed_forwards. `Forwards` here runs one request's, the DREAM
stage's when it carries one.)

A position's logits must not depend on the block it is computed in, or a pipeline's answer can differ
from the target alone's wherever two tokens nearly tie.
What changes with the block is the shapes the kernels see: how many rows a matrix product has (its
library picks a kernel by it) and how many keys a row attends over. So here every forward attends over
its request's whole `StaticKV` (entries past the request's length masked) and feeds one of a few fixed
widths, powers of two from `min_width` to `max_width`: a feed is cut into pieces of at most `max_width`
tokens and each piece padded, after its real tokens, to the least width that holds it. Padding rows sit
after the real ones, so causality hides them from the real rows; their keys land past the request's
length and are overwritten later. The target alone runs the same path, so its answer is the pipeline's.

Which widths agree is a property of the device's kernels (`tests/test_forwards.py` checks it on every run):
- on a CPU a row's result depends on the row count below 4 rows, not from 4 on: the target's forwards are at
  least 4 wide;
- on a GPU the matrix kernels change with the row count: every forward is `max_width` wide.
Only the target pads: a drafter's logits pick drafts, never the answer.

Compiled (`torch.compile`, inductor; on a GPU replayed from CUDA graphs captured per cache and width,
pipespec.stages.cuda_graphs), each width is compiled once, when the stage starts (`warm_up`), at the
torch thread count it will serve with; inductor keeps what it compiled on disk
(TORCHINDUCTOR_CACHE_DIR, by default under /tmp), so a restart reads it back instead of compiling
again. Prefill stays eager: its length changes with every prompt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pipespec.errors import ConfigError
from pipespec.stages.cuda_graphs import GraphedStep, Step
from pipespec.stages.kv_pool import KVPool, RequestCache

if TYPE_CHECKING:
    from pipespec.schema.kinds import ModelOptions

log = logging.getLogger(__name__)

MOST_GRAPHS = 64  # compiled graphs of one stage kind per process (dynamo's default, 8, is two stages' widths)
DEFAULT_CONTEXT = 4096  # most context tokens per request when neither the model nor the config says less
# A CUDA graph's replay overwrites the outputs of the replay before it (a stage's graphs share one memory
# pool) and its input buffers: replays, and copying their outputs out, are one at a time in a process (a
# device runs them one after another anyway).
_GRAPHS = threading.Lock()


def _compile_default() -> bool:
    """`PIPESPEC_COMPILE` (0 or 1) where set, else compiled: faster on CPUs and GPUs (experiments/RESULTS.md)."""
    value = os.environ.get("PIPESPEC_COMPILE", "1")
    if value not in ("0", "1"):
        raise ConfigError(f"PIPESPEC_COMPILE: expected 0 or 1, got {value!r}")
    return value == "1"


def least_width(device: torch.device, max_width: int) -> int:
    """The least forward width at which a position's logits do not depend on its block (measured: see above)."""
    return min(4, max_width) if device.type == "cpu" else max_width


@dataclass(frozen=True)
class Shapes:
    """The fixed shapes of a stage's forwards: the context a request may hold and the widths it feeds."""

    context: int  # most context tokens (prompt + generated) one request may hold
    widths: tuple[int, ...]  # ascending powers of two; a piece of n tokens runs at the least width >= n

    @property
    def room(self) -> int:
        """The cache slots a request needs past its context: a forward's padding, or a draft tree's nodes and the
        path it attends over (pipespec.stages.packing.TreeRows)."""
        return 3 * self.widths[-1]

    @property
    def capacity(self) -> int:
        """Each request's cache length: its context and `room`."""
        return self.context + self.room

    @classmethod
    def of(cls, options: ModelOptions, model_limit: int | None, device: torch.device, target: bool) -> Shapes:
        """A drafter's logits only pick drafts, never the answer: by default it feeds every width, unpadded."""
        context = min(model_limit or DEFAULT_CONTEXT, options.max_context or DEFAULT_CONTEXT)
        least = options.min_width or (least_width(device, options.max_width) if target else 1)
        widths = tuple(w for w in (2**i for i in range(options.max_width.bit_length())) if least <= w)
        return cls(context, widths)

    def check_context(self, stage: str, end: int) -> None:
        """A ValueError naming the limit if a request's context would reach `end` tokens, past `context`."""
        if end > self.context:
            raise ValueError(f"stage {stage!r}: {end} context tokens exceed its max_context of {self.context}")

    def pieces(self, n: int) -> list[tuple[int, int, int]]:
        """-> (start, length, width) of each piece of an n-token feed."""
        widest = self.widths[-1]
        out = []
        for start in range(0, n, widest):
            length = min(widest, n - start)
            out.append((start, length, next(w for w in self.widths if w >= length)))
        return out


class Forwards:
    """A stage's decode and verification forwards: `step` at fixed widths, eager or compiled."""

    def __init__(self, stage: str, step: Step, shapes: Shapes, compiled: bool, device: torch.device):
        self.stage = stage
        self.shapes = shapes
        self.compiled = compiled
        self.device = device
        self.warmup_s = 0.0
        if compiled:  # every stage's widths are graphs of one function (a stage kind's `_step`): room for all of them
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MOST_GRAPHS)
            step = torch.compile(step, dynamic=False, options={"guard_filter_fn": _without_registry_guards})
        self.graphs = compiled and device.type == "cuda"  # replays CUDA graphs
        self.step = GraphedStep(step) if self.graphs else step

    @torch.inference_mode()
    def __call__(self, cache: RequestCache, keep: int, tokens: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Feed `tokens` after the first `keep` entries of `cache`; -> each output of `step` for the real rows [n, ...]."""
        self.shapes.check_context(self.stage, keep + len(tokens))
        parts = []
        with _GRAPHS if self.graphs else contextlib.nullcontext():
            for start, length, width in self.shapes.pieces(len(tokens)):
                piece = list(tokens[start : start + length])
                at = keep + start
                ids = torch.tensor([piece + piece[-1:] * (width - length)], dtype=torch.long, device=self.device)  # [1, w]
                positions = torch.arange(at, at + width, device=self.device)  # [w]
                cache.rewind(at)
                outs = self.step(cache, ids, positions)  # a graph's outputs: overwritten by its next replay, copied now
                parts.append([out[0, :length].clone() if self.graphs else out[0, :length] for out in outs])
        cache.rewind(keep + len(tokens))
        return tuple(outs[0] if len(outs) == 1 else torch.cat(outs) for outs in zip(*parts))

    def warm_up(self, caches: KVPool, filler: int) -> None:
        """Run every width once on a cache of the stage's pool (compiling it, when compiled); the time is logged and kept."""
        began = time.perf_counter()
        cache = caches.take(caches.capacity)
        try:
            for width in self.shapes.widths:
                self(cache, 0, [filler] * width)
        finally:
            caches.give(cache)
        self.warmup_s = time.perf_counter() - began
        how = "compiled" if self.compiled else "eager"
        log.info("stage %r: %s forwards at widths %s warmed up in %.1f s", self.stage, how, self.shapes.widths, self.warmup_s)


def _without_registry_guards(entries: Sequence) -> list[bool]:
    """Keep the guards on what a forward is given, drop those on what never changes once a stage is
    built: its modules (checking them costs a share of every call), and
    transformers' registry of output captures, which grows whenever another model class first runs
    (a drafter loading beside the target, the vision tower's first prefill) and would recompile a
    forward mid-request, while what it adds never enters our graphs."""
    return [
        "_CAN_RECORD_REGISTRY" not in entry.name and not entry.orig_guard.source.is_unspecialized_nn_module() for entry in entries
    ]


def compiles(options: ModelOptions) -> bool:
    """Whether a stage with `options` compiles its forwards."""
    return _compile_default() if options.compile is None else options.compile
