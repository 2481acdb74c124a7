"""A stage's KV caches (pipespec.stages.kv_pool): sized to what a request can use, admitted within the stage's
budget, reused (a closed request's cache, emptied, serves the next request of its size; no cache is ever
held by two requests); and a request's logits do not depend on its cache's size."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pipespec.stages.kv_pool import SIZE_STEP
from pipespec.stages.static_kv import StaticKV, static_pool

CONFIG = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
PER_POSITION = 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 KV heads, head dim 16, fp32


def pool(capacity: int = 1032, budget: int | None = None):
    return static_pool(CONFIG, capacity, torch.float32, torch.device("cpu"), budget)


def test_a_given_back_cache_serves_the_next_request_of_its_size_empty():
    caches = pool()
    first, second = caches.take(512), caches.take(512)
    assert first is not second and caches.made == 2
    first.rewind(9)
    caches.give(first)
    again = caches.take(512)
    assert again is first and again.length == 0 and caches.made == 2
    assert caches.take(1024) is not second and caches.made == 3  # another size: a cache of its own


def test_a_cache_given_back_twice_is_refused():
    caches = pool()
    cache = caches.take(512)
    caches.give(cache)
    with pytest.raises(RuntimeError, match="given back twice"):
        caches.give(cache)


def test_sizes_round_up_to_the_step_and_stop_at_the_capacity():
    caches = pool(capacity=1032)
    assert [caches.size_for(n) for n in (1, 512, 513, 1024, 1025, 5000)] == [512, 512, 1024, 1024, 1032, 1032]
    cache = caches.take(512)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert StaticKV.bytes_for(CONFIG, 512, torch.float32) == 512 * PER_POSITION == held


def test_admission_within_the_budget_and_a_request_over_it_named():
    caches = pool(budget=3 * 512 * PER_POSITION)
    held = [caches.take(512), caches.take(1024)]
    assert caches.in_use == 3 * 512 * PER_POSITION and caches.use == 1.0
    assert not caches.admits(512)  # full: the next request waits
    caches.give(held.pop())
    assert caches.admits(1024) and not caches.admits(1032)
    caches.give(held.pop())
    assert caches.admits(1032)  # nothing held: a request that fits the budget at all is admitted
    with pytest.raises(ValueError, match=r"stage 't': a request's KV cache of 2048 positions takes .* MiB, more than"):
        pool(capacity=4096, budget=3 * 512 * PER_POSITION).check("t", 2048)


def test_idle_caches_of_other_sizes_make_room():
    caches = pool(budget=2 * 512 * PER_POSITION)
    small = [caches.take(512), caches.take(512)]
    for cache in small:
        caches.give(cache)
    big = caches.take(1024)  # the two idle 512s are dropped: the pool stays within its budget
    assert caches.held == 1024 * PER_POSITION and big.capacity == 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_a_smaller_cache_is_bitwise_the_whole_capacitys(dtype):
    """What sizing rests on (torch's CPU flash attention reads keys in blocks of SIZE_STEP): attending over the
    first multiple of SIZE_STEP keys that holds every query's position equals attending over all of them."""
    generator = torch.Generator().manual_seed(0)
    attend = torch.nn.functional.scaled_dot_product_attention
    for capacity in (520, 1032, 4104):
        for trial in range(12):
            rows = 1 + trial % 8
            position = int(torch.randint(0, capacity - 8, (), generator=generator))
            q = torch.randn(1, 4, rows, 64, generator=generator).to(dtype)
            k, v = (torch.randn(1, 4, capacity, 64, generator=generator).to(dtype) for _ in range(2))
            seen = torch.arange(position, position + rows)[:, None]
            whole = attend(q, k, v, attn_mask=(torch.arange(capacity)[None] <= seen)[None, None])
            size = min(capacity, -(-(position + rows) // SIZE_STEP) * SIZE_STEP)
            part = attend(q, k[:, :, :size], v[:, :, :size], attn_mask=(torch.arange(size)[None] <= seen)[None, None])
            assert torch.equal(whole, part), (capacity, position, rows)
