"""A small random Idefics3: SigLIP-style tower (32x32 images, 4x4 patches, pixel shuffle by 2: 16 image tokens, no splitting), Llama text."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    Idefics3VisionConfig,
)

from experiments.toy_models import llama_config
from experiments.vlm_zoo import family_tokenizer, save_vlm, shrink_branches

IMAGE, PATCH, SCALE = 32, 4, 2
IMAGE_SEQ_LEN = (IMAGE // PATCH) ** 2 // SCALE**2  # 16
SPECIAL_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]

# Idefics3-8B-Llama3's template ("User:<image>text<end_of_utterance>\nAssistant:"), bos from this tokenizer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build(out: Path, seed: int = 0) -> Path:
    tokenizer = family_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE, seed=seed)
    vision = Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=PATCH,
    )
    text = llama_config(len(tokenizer), hidden=64, layers=2, heads=4)
    text.max_position_embeddings = 512
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    shrink_branches(model, seed=seed)
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": IMAGE},
        max_image_size={"longest_edge": IMAGE},
        do_image_splitting=False,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    return save_vlm(model, processor, out)
