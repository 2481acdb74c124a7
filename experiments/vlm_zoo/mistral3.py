"""A small random Mistral 3 (Mistral Small 3.1): Pixtral tower (8x8 patches, 2x2 merge, images up to 64x64: <= 20 image tokens with row breaks), Mistral text."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralImageProcessor,
    PixtralVisionConfig,
)

from experiments.vlm_zoo import family_tokenizer, save_vlm_parts, shrink_branches

PATCH, MERGE, LONGEST_EDGE = 8, 2, 64  # one image token per 16x16 pixels, at most 4x4 plus a break/end token per row
SPECIAL_TOKENS = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]

# Mistral-Small-3.1-Instruct's template, simplified: "<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST][IMG]text[/INST]".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[/INST]{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def build(out: Path, seed: int = 0) -> Path:
    tokenizer = family_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE, seed=seed)
    vision = PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        image_size=LONGEST_EDGE,
        patch_size=PATCH,
    )
    text = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    config = Mistral3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=MERGE,
        vision_feature_layer=-1,
        tie_word_embeddings=False,  # tied, each token would predict itself here (small branches)
    )
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config).eval()
    shrink_branches(model, seed=seed)
    image_processor = PixtralImageProcessor(
        size={"longest_edge": LONGEST_EDGE},
        patch_size={"height": PATCH, "width": PATCH},
    )
    # PixtralProcessor needs torchvision (transformers 5.23: its module imports the torchvision image
    # processor): save its parts; `pipespec.processors` builds it back for images only.
    return save_vlm_parts(model, image_processor, tokenizer, "PixtralProcessor", out, patch_size=PATCH, spatial_merge_size=MERGE)
