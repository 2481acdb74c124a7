"""The `vlm` stage's own costs, bf16 vs fp32: prefill with an image, per-token decode, block verification.

The model is the largest this 2-core CPU handles comfortably: TinyLLaVA geometry (a CLIP ViT-B/14
tower at 224x224, 576 image tokens, and a TinyLlama-1.1B language model), random weights, built from
a config, saved, and loaded back through the `vlm` stage exactly as a user's checkpoint would be.

    python -m experiments.bench_vlm [--out experiments/results/bench_vlm.json] [--repeats 3]

Prints, per dtype, medians over `--repeats` runs: prefill seconds (prompt with the image), decode
milliseconds per token (one token per forward), and the time of one verification forward of k tokens
(k = 1, 4, 8) relative to k = 1 (flat = verifying a draft block costs what one token does).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from demo.llava_template import CHAT_TEMPLATE
from pipespec.commands.logs import add_log_level, setup_logging
from tests.fixtures.vlm_zoo.common import family_tokenizer

log = logging.getLogger(__name__)

MODEL_DIR = Path(".cache/bench-vlm-tinyllava")
PROMPT = "Describe the picture in detail: which shapes are there, and what colour is each?"


def build(out: Path) -> Path:
    """TinyLLaVA-1.1B geometry with random weights, saved with its processor (once; reused after)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    if (out / "config.json").is_file():
        return out
    tokenizer = family_tokenizer(["<image>"], CHAT_TEMPLATE)
    vision = CLIPVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        image_size=336, patch_size=14, projection_dim=768,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(model_dir: Path, dtype: str, repeats: int, decode_tokens: int = 16) -> dict:
    from pipespec import LocalPipeline, load_config

    config = load_config({"stages": [{"name": "target", "kind": "vlm", "model": str(model_dir), "dtype": dtype}]})
    pipe = LocalPipeline(config, torch_threads=None)  # loads the stage; its runner never starts here
    stage = pipe.stages[-1]
    image = Image.fromarray((np.random.default_rng(0).random((480, 640, 3)) * 255).astype(np.uint8))
    spec, _ = pipe.request(PROMPT, image=image, max_new_tokens=64)
    params = sum(p.numel() for p in stage.model.parameters())
    stage.open(spec).close()  # warm up
    prefill = median_s(lambda: stage.open(spec).close(), repeats)

    session = stage.open(spec)
    start = session.prompt_len - 1
    try:

        def decode() -> None:
            token = session.last_prompt_token
            for i in range(decode_tokens):
                token = int(session.forward(start + i, [token])[0].argmax())

        per_token = median_s(decode, repeats) / decode_tokens
        verify = {}
        for k in (1, 4, 8):
            block = [session.last_prompt_token] + [7] * (k - 1)
            verify[k] = median_s(lambda b=block: session.forward(start, b), repeats * 3)
    finally:
        session.close()
    return {
        "dtype": dtype,
        "parameters": params,
        "prompt_tokens": len(spec.prompt_token_ids),
        "image_tokens": spec.prompt_token_ids.count(stage.image_token_id),
        "prefill_s": prefill,
        "decode_ms_per_token": per_token * 1e3,
        "verify_ms": {str(k): v * 1e3 for k, v in verify.items()},
        "verify_relative_to_1": {str(k): v / verify[1] for k, v in verify.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/bench_vlm.json"))
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--repeats", type=int, default=3)
    add_log_level(parser, default="INFO")
    args = parser.parse_args()
    setup_logging(args.log_level, fmt="%(message)s")
    torch.set_num_threads(torch.get_num_threads())
    model_dir = build(args.model_dir)
    rows = [measure(model_dir, dtype, args.repeats) for dtype in ("bfloat16", "float32")]
    print(f"vlm stage, TinyLLaVA geometry ({rows[0]['parameters'] / 1e9:.2f}B parameters), {torch.get_num_threads()} threads")
    print(f"prompt {rows[0]['prompt_tokens']} tokens ({rows[0]['image_tokens']} image tokens); medians of {args.repeats}")
    print(f"{'dtype':<10}{'prefill s':>10}{'decode ms/tok':>15}{'verify 1':>10}{'verify 4':>10}{'verify 8':>10}")
    for r in rows:
        v = r["verify_ms"]
        rel = r["verify_relative_to_1"]
        print(
            f"{r['dtype']:<10}{r['prefill_s']:>10.2f}{r['decode_ms_per_token']:>15.1f}"
            f"{v['1']:>8.1f}ms{v['4']:>6.1f}ms x{rel['4']:.2f}{v['8']:>6.1f}ms x{rel['8']:.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
