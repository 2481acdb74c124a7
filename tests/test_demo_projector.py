"""How the demo target's projector starts (demo/projector.py): standardised features, and read-outs of each
cell's contents as its first rows."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPVisionModel

from demo.projector import init_projector, tower_features
from demo.tower import Heads
from demo.train import build_target, load_tokenizer
from demo.world import CELLS
from tests.fixtures import DEMO_MODELS as MODELS

SMALL = dict(hidden=64, layers=1, heads=1, intermediate=128)  # the language model's size does not matter here
HEADS = Heads()
SIZES = (HEADS.kind, HEADS.colour, HEADS.size, HEADS.word, len(CELLS))  # the read-outs' classes, in their order


@pytest.fixture(scope="module")
def target():
    """A fresh target over the shipped tower, its projector still at random, and fresh pictures' features."""
    model, processor = build_target(load_tokenizer(MODELS), shape=SMALL)
    model.model.vision_tower.load_state_dict(CLIPVisionModel.from_pretrained(MODELS / "tower", dtype=torch.float32).state_dict())
    x, labels = tower_features(model, processor.image_processor, scenes=128, seed=1)  # [M, H], [M, 5]
    return model, processor, x, labels


def first_layer(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.model.multi_modal_projector.linear_1(x)  # [M, hidden]


def readout_accuracy(h: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """How often each read-out's rows of `h` pick its label, per head."""
    starts = torch.tensor((0, *SIZES)).cumsum(0).tolist()
    return [(h[:, a:b].argmax(-1) == labels[:, j]).float().mean().item() for j, (a, b) in enumerate(zip(starts, starts[1:]))]


def test_the_first_rows_read_each_cell_and_the_rest_see_standardised_features(target):
    model, processor, x, labels = target
    assert max(readout_accuracy(first_layer(model, x), labels)) < 0.7  # at random the rows read nothing
    linear = model.model.multi_modal_projector.linear_1
    weight, bias = linear.weight[sum(SIZES) :].clone(), linear.bias[sum(SIZES) :].clone()  # the rows kept at random
    init_projector(model, processor.image_processor, seed=0, scenes=256)

    h = first_layer(model, x)  # fresh pictures, not those the read-outs were fit on
    assert min(readout_accuracy(h, labels)) > 0.95  # kind, colour, size, word and cell, each read by its rows
    assert ((h[:, : sum(SIZES)].std(0).reshape(-1)).mean() - 1).abs() < 0.5  # about as loud as unit logits

    assert x.std(0).max() > 5  # raw: far from standardised
    scale = (weight / linear.weight[sum(SIZES) :]).median(0).values  # [H]: what each input column was divided by
    assert ((x.std(0) / scale - 1).abs() < 0.3).all()  # each feature spreads about 1 once scaled
    assert (h[:, sum(SIZES) :].mean(0) - bias).abs().max() < 0.05  # and its mean taken off


def test_a_projector_narrower_than_the_read_outs_is_refused():
    model, processor = build_target(load_tokenizer(MODELS), shape=dict(SMALL, hidden=32, heads=1))
    with pytest.raises(ValueError, match="32 wide, fewer than the 59 read-outs"):
        init_projector(model, processor.image_processor, seed=0, scenes=8)
