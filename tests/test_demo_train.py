"""The demo's training recipe (demo/train.py): what the target's language model is fed and learns."""

from __future__ import annotations

import math
import random
import shutil

import numpy as np
import torch
from transformers import CLIPVisionModel, LlavaForConditionalGeneration

from demo.talk import text_examples
from demo.train import (
    IMAGE_SIZE,
    PATCH,
    batches,
    build_target,
    load_tokenizer,
    standardise_projector,
    train_target,
    train_tower,
)
from demo.world import examples, random_scene, render
from tests.fixtures import DEMO_MODELS as MODELS

SMALL = dict(hidden=64, layers=1, heads=1, intermediate=128)  # a target's language model small enough to train in a test


def test_the_target_reads_the_pretrained_layer_and_learns_only_answers():
    model, processor = build_target(load_tokenizer(MODELS))
    assert model.config.vision_feature_layer == -1  # the layer the dense pretraining trains (demo.tower)
    data = batches(examples("train", 64), processor, processor.tokenizer, 4, random.Random(0))
    ids, pixels, labels = next(data)
    image_tokens = (ids == model.config.image_token_id).sum(1)
    assert image_tokens.tolist() == [(IMAGE_SIZE // PATCH) ** 2] * 4 and pixels.shape == (4, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert ((labels != -100) & (ids == model.config.image_token_id)).sum() == 0
    answers = [processor.tokenizer.decode(row[row != -100]) for row in labels]
    assert all(a.endswith(processor.tokenizer.eos_token) for a in answers)  # each answer, then the end of turn


def test_questions_without_a_picture_are_fed_without_one():
    model, processor = build_target(load_tokenizer(MODELS), shape=SMALL)
    mixed = examples("train", 6) + text_examples("train", 6)
    ids, pixels, labels = next(batches(mixed, processor, processor.tokenizer, 12, random.Random(0)))
    with_picture = (ids == model.config.image_token_id).any(1)
    assert with_picture.sum() == 6 and pixels.shape[0] == 6  # a picture for each row that has one, in order
    assert model(input_ids=ids, pixel_values=pixels).logits.shape[:2] == ids.shape  # LLaVA matches them to rows


def test_the_target_trains_over_the_pretrained_tower_it_ships_with(tmp_path):
    shutil.copytree(MODELS / "tokenizer", tmp_path / "tokenizer")
    train_tower(tmp_path, math.inf, 2, seed=0)
    train_target(tmp_path, math.inf, 2, 2, seed=0, shape=SMALL)
    tower = CLIPVisionModel.from_pretrained(tmp_path / "tower").state_dict()
    target = LlavaForConditionalGeneration.from_pretrained(tmp_path / "target")
    assert target.config.text_config.hidden_size == SMALL["hidden"]
    shipped = target.model.vision_tower.state_dict()
    assert shipped.keys() == tower.keys() and all(torch.equal(shipped[k], tower[k]) for k in tower)  # frozen while it learnt


def test_the_projector_starts_from_standardised_features():
    """The tower's raw features are far from standardised; with their mean and spread folded into the
    projector's first layer, each dimension of fresh pictures' features reaches it with mean about 0 and
    spread about 1."""
    model, processor = build_target(load_tokenizer(MODELS), shape=SMALL)
    with torch.no_grad():
        for p in model.model.vision_tower.parameters():  # a tower whose features are far from standardised
            p.add_(torch.randn_like(p) * 0.5)
    linear = model.model.multi_modal_projector.linear_1
    weight, bias = linear.weight.clone(), linear.bias.clone()
    standardise_projector(model, processor.image_processor, seed=0, scenes=256)
    rng = np.random.default_rng(1)
    pixels = processor.image_processor(images=[render(random_scene(rng), IMAGE_SIZE) for _ in range(256)], return_tensors="pt")
    with torch.no_grad():
        x = model.model.vision_tower(pixel_values=pixels["pixel_values"]).last_hidden_state[:, 1:].reshape(-1, weight.shape[1])
    scale = (weight / linear.weight).median(0).values  # [H]: what each input dimension's column was divided by
    assert x.std(0).min() > 5  # raw: far from standardised
    assert ((x.std(0) / scale - 1).abs() < 0.3).all()  # each spreads about 1 once scaled
    shift = bias - linear.bias  # (W / std) mean: the features' mean, taken off
    assert (shift - linear.weight @ x.mean(0)).norm() < 0.1 * shift.norm()
