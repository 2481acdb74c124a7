"""A small random Qwen2-VL: native-resolution tower (8x8 patches, 2x2 merge, <= 32 image tokens), Qwen2 text with M-RoPE."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLTextConfig,
    Qwen2VLVisionConfig,
)

from experiments.vlm_zoo import family_tokenizer, save_vlm_parts, shrink_branches

PATCH, MERGE = 8, 2
FACTOR = PATCH * MERGE  # images are resized to multiples of 16 pixels; one image token per 16x16
MIN_PIXELS, MAX_PIXELS = 4 * FACTOR**2, 32 * FACTOR**2  # 4 to 32 image tokens
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL-Instruct's template without videos and picture numbering.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(out: Path, seed: int = 0) -> Path:
    tokenizer = family_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE, seed=seed)
    ids = tokenizer.convert_tokens_to_ids
    vision = Qwen2VLVisionConfig(
        depth=1,
        embed_dim=32,
        hidden_size=64,
        num_heads=2,
        mlp_ratio=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
    )
    text = Qwen2VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
        bos_token_id=1,
        eos_token_id=2,
    )
    config = Qwen2VLConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    shrink_branches(model, seed=seed)
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
    )
    # Qwen2VLProcessor insists on a video processor, and that needs torchvision (transformers 5.23; none
    # for CPU here): save the processor's parts and its class name; `pipespec.images.load_processor`
    # builds it back without the video half.
    return save_vlm_parts(model, image_processor, tokenizer, "Qwen2VLProcessor", out)
