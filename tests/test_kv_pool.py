"""A stage's KV caches are reused (pipespec.stages.kv_pool): a closed request's cache, emptied, serves the
next request; no cache is ever held by two requests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pipespec.stages.kv_pool import KVPool
from pipespec.stages.static_kv import StaticKV

CONFIG = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def pool() -> KVPool:
    return KVPool(lambda: StaticKV(CONFIG, 16, torch.float32, torch.device("cpu")))


def test_a_given_back_cache_serves_the_next_request_empty():
    caches = pool()
    first, second = caches.take(), caches.take()
    assert first is not second and caches.made == 2
    first.rewind(9)
    caches.give(first)
    again = caches.take()
    assert again is first and again.length == 0 and caches.made == 2
    assert caches.take() is not second  # `second` is still held: a third cache is made
    assert caches.made == 3


def test_a_cache_given_back_twice_is_refused():
    caches = pool()
    cache = caches.take()
    caches.give(cache)
    with pytest.raises(RuntimeError, match="given back twice"):
        caches.give(cache)
