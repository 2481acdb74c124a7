"""One request's KV cache on a model stage: preallocated at its size, rolled back by setting its length.

`StaticKV` is a transformers `Cache` whose layers are transformers' `StaticLayer`s allocated up front:
[1, kv_heads, capacity, head_dim] keys and values per layer (`capacity`: the request's size, from its
stage's pool, pipespec.stages.kv_pool), and the number of entries in use as a tensor
(`cumulative_length`). The packed attention writes a forward's keys at its rows' positions and attends
over the whole cache, entries past each row's position masked (pipespec.stages.packing); a rollback
(`rewind`) sets the number in use: no crop, no copy. Entries past it stay in place until a later forward
overwrites them, so every forward of a request attends over the same keys whatever its length (what
makes a position's logits independent of its block: pipespec.stages.forwards).

Two differences from transformers' `StaticCache`: sliding-window layers are full-length too (the
window is the mask's business, so a rollback never needs an entry a rolling buffer overwrote), and the
tensors are not marked as static addresses: one compiled forward takes any request's cache as an input
(on a GPU, a graph is captured per cache: pipespec.stages.cuda_graphs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache, PretrainedConfig
from transformers.cache_utils import StaticLayer

from pipespec.stages.kv_pool import KVPool


class _Layer(StaticLayer):
    """transformers' static layer, allocated at construction instead of at its first update."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device):
        super().__init__(max_cache_len=shape[2])
        self.dtype, self.device = dtype, device
        self.batch_size, self.num_heads, _, self.k_head_dim = shape
        self.v_head_dim = self.k_head_dim
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [1, kv_heads, capacity, head_dim]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.cumulative_length = torch.zeros((), dtype=torch.long, device=device)  # entries in use
        self.is_initialized = True


class StaticKV(Cache):
    """Keys and values for up to `capacity` positions of one request, for a model with `config`."""

    def __init__(self, config: PretrainedConfig, capacity: int, dtype: torch.dtype, device: torch.device):
        layers, heads, head_dim = _dims(config)
        shape = (1, heads, capacity, head_dim)
        super().__init__(layers=[_Layer(shape, dtype, device) for _ in range(layers)])
        self.capacity = capacity
        self.device = torch.device(device)

    @staticmethod
    def bytes_for(config: PretrainedConfig, capacity: int, dtype: torch.dtype) -> int:
        """The bytes of a cache of `capacity` positions for a model with `config`: keys and values of every layer."""
        layers, heads, head_dim = _dims(config)
        return 2 * layers * heads * capacity * head_dim * dtype.itemsize

    @property
    def length(self) -> int:
        """Entries in use: the context positions this cache holds."""
        return int(self.layers[0].cumulative_length)

    def rewind(self, length: int) -> None:
        """Hold the first `length` entries; the next forward writes its keys from there."""
        for layer in self.layers:
            layer.cumulative_length.fill_(length)

    def keep_path(self, at: int, slots: Sequence[int]) -> None:
        """After a tree forward that left `at` entries: the entries at `slots` (a path's nodes, past the length:
        pipespec.stages.packing.TreeRows) moved to at, at + 1, ..; then hold at + len(slots)."""
        if slots:
            chain = torch.arange(at, at + len(slots), device=self.device)
            sources = torch.tensor(slots, device=self.device)
            for layer in self.layers:
                layer.keys.index_copy_(2, chain, layer.keys.index_select(2, sources))
                layer.values.index_copy_(2, chain, layer.values.index_select(2, sources))
        self.rewind(at + len(slots))


def _dims(config: PretrainedConfig) -> tuple[int, int, int]:
    """-> (layers, key-value heads, head dim) of the text decoder of a model with `config`."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, heads, head_dim


def static_pool(
    config: PretrainedConfig, capacity: int, dtype: torch.dtype, device: torch.device, budget: int
) -> KVPool[StaticKV]:
    """A stage's pool of `StaticKV`s for a model with `config`: at most `capacity` positions each, `budget` bytes in use."""
    return KVPool(
        lambda size: StaticKV(config, size, dtype, device), lambda size: StaticKV.bytes_for(config, size, dtype), capacity, budget
    )
