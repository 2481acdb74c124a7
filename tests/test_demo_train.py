"""The demo's training recipe (demo/train.py): the target's shape and its batches."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from demo.train import BUCKETS, IMAGE_SIZE, PATCH, batches, build_target, load_tokenizer
from demo.world import examples

MODELS = Path(__file__).resolve().parents[1] / "models" / "demo"


def test_the_target_keeps_the_pretrained_layer_and_the_class_token():
    model, processor = build_target(load_tokenizer(MODELS))
    assert model.config.vision_feature_layer == -1  # the layer the dense pretraining trains (demo.tower)
    assert model.config.vision_feature_select_strategy == "full"  # the class token learnt the background and count
    data = batches(examples("train", 64), processor, processor.tokenizer, 4, random.Random(0))
    ids, pixels, labels = next(data)
    image_tokens = (ids == model.config.image_token_id).sum(1)
    assert image_tokens.tolist() == [1 + (IMAGE_SIZE // PATCH) ** 2] * 4 and pixels.shape == (4, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert ((labels != -100) & (ids == model.config.image_token_id)).sum() == 0  # only answers are learnt


def test_batches_are_cut_from_length_sorted_pools():
    tokenizer = load_tokenizer(MODELS)
    pool = examples("train", 16 * BUCKETS)
    data = batches(pool, None, tokenizer, 16, random.Random(0), with_image=False)
    padded = [next(data)[2] for _ in range(BUCKETS)]  # one pool: every example once
    answered = sorted(int((lab != -100).sum(1).max()) * 16 for lab in padded)
    real = sum(int((lab != -100).sum()) for lab in padded)
    unsorted = random.Random(1).sample(pool, len(pool))
    longest = [
        max(len(tokenizer(" " + ex.answer)["input_ids"]) + 1 for ex in unsorted[i : i + 16]) * 16 for i in range(0, len(pool), 16)
    ]
    assert sum(answered) - real < 0.5 * (sum(longest) - real)  # far less padding than random batches
    assert sum(int((lab != -100).sum()) for lab in padded) == sum(len(tokenizer(" " + ex.answer)["input_ids"]) + 1 for ex in pool)
    assert torch.is_tensor(padded[0])
