"""The demo's training recipe (demo/train.py): what the target's language model is fed and learns."""

from __future__ import annotations

import random

from demo.train import IMAGE_SIZE, PATCH, batches, build_target, load_tokenizer
from demo.world import examples
from tests.fixtures import DEMO_MODELS as MODELS


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
