"""What a target measures when it starts so that a row's result is its own (pipespec.stages.invariance).

Whatever this CPU is, the least row count `measure` finds holds: products with the model's own weights, as
laid out, on fresh inputs at random row counts from it up to the most a forward runs, give every row bitwise
what it is at the most rows; attention with its query rows padded by the step found does too. A drafter and a
GPU stage measure nothing.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipespec.stages.invariance import NONE_NEEDED, Invariance, fit_model, measure
from pipespec.stages.weight_layout import column_major

MOST = 160


@pytest.fixture()
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1408, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=256,
    )  # fmt: skip
    return column_major(LlamaForCausalLM(config).eval())


def _weights(model) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_the_rows_it_finds_hold_on_fresh_inputs(model):
    found = fit_model("t", model, least=4, capacity=520, most=MOST)
    assert found.holds, found  # one thread (the suite's): some least count holds here, in one layout or the other
    rng = random.Random(1)
    generator = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for weight in _weights(model):  # as fit_model left them laid out
            x = torch.randn(MOST, weight.shape[1], generator=generator)
            full = torch.nn.functional.linear(x, weight)
            for m in rng.sample(range(found.rows, MOST + 1), 12):
                assert torch.equal(torch.nn.functional.linear(x[:m], weight), full[:m]), (tuple(weight.shape), m)


def test_the_query_step_it_finds_holds_on_fresh_queries():
    found = measure([], heads=4, head_dim=128, capacity=520, dtype=torch.float32, most=MOST)
    generator = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 1, 4, 520, 128, generator=generator)
    queries = torch.randn(1, 4, MOST, 128, generator=generator)
    positions = torch.arange(MOST) * 3

    def attend(n: int) -> torch.Tensor:
        mask = torch.arange(520)[None, :] <= positions[:n, None]
        return torch.nn.functional.scaled_dot_product_attention(queries[:, :, :n], keys, values, attn_mask=mask[None, None])

    full = attend(MOST)
    for n in range(1, 70):
        padded = min(MOST, found.query_rows(n))
        assert torch.equal(attend(padded)[:, :, :n], full[:, :, :n]), (n, padded)


def test_a_drafter_measures_nothing(model):
    assert fit_model("d", model, least=1, capacity=520, most=MOST) is NONE_NEEDED


def test_query_rows_pad_to_the_step():
    assert [Invariance(queries=8).query_rows(n) for n in (1, 8, 9, 33)] == [8, 8, 16, 40]
