"""What the Hugging Face model stages (causal_lm, vlm) share: their forwards' fixed shapes, their packed forwards
over a pool of static KV caches within the stage's budget, warmed up when the stage starts, and admission by a
request's cache size (pipespec.engine.stage.AdmittingStage); and what their sessions share (`PackedSession`): a
cache taken from the stage's pool and given back on close, forwards and tree forwards that are the stage's packed
ones, a path kept moved within the cache."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipespec.engine.stage import Feed, TreeNodes, check_length
from pipespec.protocol.messages import RequestSpec
from pipespec.schema.kinds import ModelOptions
from pipespec.stages.build_context import BuildContext
from pipespec.stages.device import kv_budget
from pipespec.stages.forwards import Shapes, compiles
from pipespec.stages.invariance import fit_model
from pipespec.stages.kv_pool import KVPool
from pipespec.stages.packed_forwards import PackedForwards
from pipespec.stages.static_kv import StaticKV, static_pool

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from pipespec.config import StageSpec


def eos_ids(model: PreTrainedModel, fallback: Any) -> frozenset[int]:
    """The tokens that end a generation: the model's generation config's, else `fallback` (an int, a list or None)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = fallback
    return frozenset([eos] if isinstance(eos, int) else eos or [])


class PackedModelStage:
    """A model stage's forwards and caches. A subclass sets `name`, `device`, `dtype`, `model` (its weights on the
    device), `eos_token_ids` and a `_step` (one packed forward), then calls `_pack`; it says how many positions a
    request's cache takes (`cache_size`)."""

    name: str
    device: torch.device
    dtype: torch.dtype
    model: PreTrainedModel
    eos_token_ids: frozenset[int]
    shapes: Shapes
    max_context: int | None
    prefill_rows: int
    forwards: PackedForwards
    caches: KVPool[StaticKV]

    def _pack(self, spec: StageSpec, at: BuildContext, limit: int | None, lock: threading.RLock) -> None:
        """Its shapes (a context of at most `limit` tokens, the model's), packed forwards of up to `spec.max_batch`
        requests and caches within its KV budget, as `spec`'s options say; every row bucket warmed up (compiled)."""
        options = spec.options if spec.options is not None else ModelOptions()
        self.shapes = Shapes.of(options, limit, self.device, target=len(at.chain) <= 1)
        self.max_context = self.shapes.context
        self.prefill_rows = options.prefill_chunk
        most = max(spec.max_batch * self.shapes.widths[-1], self.prefill_rows)  # rows of its widest forward
        invariance = fit_model(self.name, self.model, self.shapes.widths[0], self.shapes.capacity, most)
        self.forwards = PackedForwards(
            self.name, self._step, self.shapes, spec.max_batch, compiles(options), self.device, lock, invariance
        )
        budget = kv_budget(self.device, options.kv_budget_gib)
        self.caches = static_pool(self.model.config, self.shapes.capacity, self.dtype, self.device, budget)
        self.forwards.warm_up(self.caches, min(self.eos_token_ids, default=0))

    def _step(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def cache_size(self, request: RequestSpec) -> int:
        """The positions of `request`'s cache here: its prompt, its new tokens, a forward's padding."""
        raise NotImplementedError

    def positions(self, prompt: int, request: RequestSpec) -> int:
        """`cache_size` of a request whose prompt here is `prompt` tokens long."""
        return self.caches.size_for(prompt + request.max_new_tokens + self.shapes.room)

    def admits(self, request: RequestSpec) -> bool:
        """Whether `request`'s cache fits the stage's KV budget now (pipespec.engine.stage.AdmittingStage)."""
        return self.caches.admits(self.cache_size(request))

    @property
    def kv_use(self) -> float:
        return self.caches.use


class PackedSession:
    """A model stage's session over its prompt: its `StaticKV` taken from the stage's pool (given back on `close`),
    its forwards the stage's packed ones (`forward_batch`), so also a `DraftTreeSession` (pipespec.engine.stage)."""

    def __init__(self, stage: Any, prompt: Sequence[int], cache_size: int):
        """`stage`: a `PackedModelStage` with `forward_batch`; `prompt`: the stage's view of the request's."""
        self.stage = stage
        self.prompt = tuple(prompt)
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]
        self.cache: StaticKV | None = stage.caches.take(cache_size)  # last: nothing above can fail with it taken

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        ((logits, _),) = self.stage.forward_batch([Feed(self, keep, tokens)])
        return logits  # [n, V]

    def forward_nodes(self, keep: int, line: Sequence[int], nodes: TreeNodes) -> torch.Tensor:
        ((logits, _),) = self.stage.forward_batch([Feed(self, keep, line, nodes=nodes)])  # type: ignore[arg-type]
        return logits  # [len(line) + len(nodes.fed), V]

    def keep_path(self, at: int, path: Sequence[int]) -> None:
        check_length(self.stage.name, self.cache.length, at)
        gap = self.stage.forwards.tree_gap
        self.cache.keep_path(at, [at + gap + node for node in path])

    def close(self) -> None:
        if self.cache is not None:
            self.stage.caches.give(self.cache)
        self.cache = None
