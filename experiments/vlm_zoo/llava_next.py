"""A small random LLaVA-NeXT (1.6, Mistral style): CLIP tower on 24x24 tiles of 8x8 patches, anyres tiling on a tiny grid (<= 51 image tokens), Llama text."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    CLIPVisionConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
)

from experiments.toy_models import llama_config
from experiments.vlm_zoo import family_tokenizer, save_vlm, shrink_branches

TILE, PATCH = 24, 8  # a 3x3 grid of patches per tile
GRID_PINPOINTS = [[TILE, 2 * TILE], [2 * TILE, TILE], [2 * TILE, 2 * TILE]]  # anyres: at most 2x2 tiles + the base

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} [/INST]{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def build(out: Path, seed: int = 0) -> Path:
    tokenizer = family_tokenizer(["<image>"], CHAT_TEMPLATE, seed=seed)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
        projection_dim=32,
    )
    text = llama_config(len(tokenizer), hidden=64, layers=2, heads=4)
    text.max_position_embeddings = 512
    config = LlavaNextConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_grid_pinpoints=GRID_PINPOINTS,
        image_seq_length=(TILE // PATCH) ** 2,
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    shrink_branches(model, seed=seed)
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": TILE},
        crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=GRID_PINPOINTS,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    return save_vlm(model, processor, out)
