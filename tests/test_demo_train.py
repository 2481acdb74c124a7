"""The demo's training recipe (demo/train.py): what the target's language model is fed and learns."""

from __future__ import annotations

import math
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import CLIPVisionModel, LlavaForConditionalGeneration

from demo.talk import text_examples
from demo.train import (
    IMAGE_SIZE,
    PATCH,
    answer_loss,
    batches,
    build_target,
    encode_all,
    load_tokenizer,
    main,
    train_target,
    train_tower,
)
from demo.world import examples
from tests.fixtures import DEMO_MODELS as MODELS

SMALL = dict(hidden=64, layers=1, heads=1, intermediate=128)  # a target's language model small enough to train in a test


def test_the_target_reads_the_pretrained_layer_and_learns_only_answers():
    model, processor = build_target(load_tokenizer(MODELS))
    assert model.config.vision_feature_layer == -1  # the layer the dense pretraining trains (demo.tower)
    tokenizer = processor.tokenizer
    data = batches(encode_all(examples("train", 64), processor, tokenizer), 4, random.Random(0), tokenizer.pad_token_id)
    ids, pixels, labels = next(data)
    image_tokens = (ids == model.config.image_token_id).sum(1)
    assert image_tokens.tolist() == [(IMAGE_SIZE // PATCH) ** 2] * 4 and pixels.shape == (4, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert ((labels != -100) & (ids == model.config.image_token_id)).sum() == 0
    answers = [processor.tokenizer.decode(row[row != -100]) for row in labels]
    assert all(a.endswith(processor.tokenizer.eos_token) for a in answers)  # each answer, then the end of turn


def test_questions_without_a_picture_are_fed_without_one():
    model, processor = build_target(load_tokenizer(MODELS), shape=SMALL)
    mixed = examples("train", 6) + text_examples("train", 6)
    rows = encode_all(mixed, processor, processor.tokenizer)
    ids, pixels, labels = next(batches(rows, 12, random.Random(0), processor.tokenizer.pad_token_id, group=1))  # one mixed batch
    with_picture = (ids == model.config.image_token_id).any(1)
    assert with_picture.sum() == 6 and pixels.shape[0] == 6  # a picture for each row that has one, in order
    assert model(input_ids=ids, pixel_values=pixels).logits.shape[:2] == ids.shape  # LLaVA matches them to rows


def test_the_target_trains_over_the_pretrained_tower_it_ships_with(tmp_path):
    shutil.copytree(MODELS / "tokenizer", tmp_path / "tokenizer")
    train_tower(tmp_path, math.inf, 2, seed=0)
    train_target(tmp_path, math.inf, 2, 2, seed=0, shape=SMALL, pictures=12)
    tower = CLIPVisionModel.from_pretrained(tmp_path / "tower").state_dict()
    target = LlavaForConditionalGeneration.from_pretrained(tmp_path / "target")
    assert target.config.text_config.hidden_size == SMALL["hidden"]
    shipped = target.model.vision_tower.state_dict()
    assert shipped.keys() == tower.keys() and all(torch.equal(shipped[k], tower[k]) for k in tower)  # frozen while it learnt


def test_every_answer_counts_the_same_whatever_its_length():
    """A 1-token answer and a 5-token one weigh the same in the loss (token-averaged, the long one would
    weigh five times as much); prompts and padding weigh nothing."""
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 11)  # [B, T, V]
    labels = torch.full((2, 8), -100)
    labels[0, 3:8] = torch.tensor([1, 2, 3, 4, 5])  # a long answer
    labels[1, 6] = 7  # a short one, then padding
    token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")  # [B, T - 1]
    long, short = token[0, 2:7].mean(), token[1, 5]
    assert torch.allclose(answer_loss(logits, labels), (long + short) / 2)
    assert not torch.allclose(answer_loss(logits, labels), (token[0, 2:7].sum() + short) / 6)


def test_batches_are_grouped_by_length_and_draw_every_example_once_a_pass():
    """Grouped (the default), a pass over the examples pads far less than drawn in order (group=1), and still
    feeds each conversation exactly once."""
    _, processor = build_target(load_tokenizer(MODELS), shape=SMALL)
    tokenizer = processor.tokenizer
    pool = examples("train", 48) + text_examples("train", 16)  # descriptions (long) among short questions
    rows = encode_all(pool, processor, tokenizer)

    def one_pass(group: int) -> tuple[list[str], int]:
        data = batches(rows, 4, random.Random(0), tokenizer.pad_token_id, group=group)
        answers, padding = [], 0
        for _ in range(len(pool) // 4):
            ids, _, labels = next(data)
            answers += [tokenizer.decode(row[row != -100][:-1]).strip() for row in labels]
            padding += (ids == tokenizer.pad_token_id).sum().item()
        return answers, padding

    grouped, grouped_padding = one_pass(group=16)
    in_order, in_order_padding = one_pass(group=1)
    assert sorted(grouped) == sorted(in_order) == sorted(ex.answer for ex in pool)
    assert grouped_padding < in_order_padding / 3


def test_encoding_on_worker_processes_gives_the_rows_in_process_encoding_gives():
    _, processor = build_target(load_tokenizer(MODELS), shape=SMALL)
    pool = examples("train", 10) + text_examples("train", 3)
    alone, shared = encode_all(pool, processor, processor.tokenizer), encode_all(pool, processor, processor.tokenizer, workers=2)
    assert [(ids, labels) for ids, labels, _ in alone] == [(ids, labels) for ids, labels, _ in shared]
    assert all((a is None and b is None) or torch.equal(a, b) for (_, _, a), (_, _, b) in zip(alone, shared))
    assert [pixels is None for _, _, pixels in shared] == [False] * 10 + [True] * 3  # the text-only questions, in place


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--device", "tpu9"], "--device tpu9"),
        (["--device", "meta"], "--device meta: cpu or cuda"),
        (["--workers", "0"], "--workers 0"),
    ],
)
def test_bad_training_flags_are_refused_by_name(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["target", *flags])
    assert exit_.value.code == 2 and named in capsys.readouterr().err
