"""A small random Gemma 3: SigLIP tower (32x32 images, 4x4 patches pooled to 16 image tokens, no pan-and-scan), Gemma 3 text."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

from experiments.vlm_zoo import family_tokenizer, save_vlm, shrink_branches

IMAGE, PATCH, IMAGE_TOKENS = 32, 4, 16  # 8x8 patches average-pooled to 4x4
BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# Gemma 3 normalizes each residual branch (post_attention_layernorm, post_feedforward_layernorm), so the
# branches are scaled through those norms' weights (the norm multiplies by 1 + weight), not through o_proj / down_proj.
ATTN_BRANCH, MLP_BRANCH = 0.6, 0.05

# gemma-3-it's template (a system message is folded into the first user turn; assistant is "model").
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] if messages[0]['content'] is string else messages[0]['content'][0]['text'] %}"
    "{% set first_user_prefix = sys + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build(out: Path, seed: int = 0) -> Path:
    tokenizer = family_tokenizer([BOI, EOI, IMAGE_TOKEN, "<start_of_turn>", "<end_of_turn>"], CHAT_TEMPLATE, seed=seed)
    tokenizer._set_model_specific_special_tokens({"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN})
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=PATCH,
    )
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=1024,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    config = Gemma3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
        tie_word_embeddings=False,  # Gemma 3 ties its head; tied, each token would predict itself here (small branches)
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    shrink_branches(model, seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for layer in model.get_decoder().layers:
            layer.post_attention_layernorm.weight.fill_(ATTN_BRANCH - 1.0)
            layer.post_feedforward_layernorm.weight.fill_(MLP_BRANCH - 1.0)
        # Gemma 3 initializes the image projection to zeros: the image would not reach the text at all.
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0, generator=g)
    image_processor = Gemma3ImageProcessor(size={"height": IMAGE, "width": IMAGE}, do_pan_and_scan=False)
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    return save_vlm(model, processor, out)
