"""A production-shaped target's forwards on this machine's device, through a stage's own path, beside the floor.

    python -m experiments.forward_floor [--shape 7b] [--device cuda] [--dtype bfloat16] [--blocks 1 2 3 4 5 6 7 8]
                                        [--prompt 512] [--repeats 30] [--json FILE]

The demo's models are small; what a GPU user runs is a 7B target. This builds a random-weight model of
the shape (Qwen2.5-7B's or -0.5B's: a forward's cost does not depend on the weights' values) on the
device, wraps it in a `CausalLMStage` (its KV pool, fixed widths, eager then compiled: on a GPU CUDA
graphs, pipespec.stages.forwards), prefills a prompt of --prompt tokens and feeds each block size again
and again at the same place (pipespec.planning.profiling.time_forwards). Beside them, the floor: one
matrix-vector product over as many weights as a forward reads, in the same dtype on the same device
(experiments.verify_cost.floor_s). The compile time of the compiled stage is its warm-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from experiments.verify_cost import cells, floor_s, streamed
from pipespec.commands.logs import parse_logged
from pipespec.config import StageSpec
from pipespec.planning.profiling import time_forwards
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.schema.kinds import ModelOptions
from pipespec.stages.causal_lm import DTYPES, CausalLMStage

log = logging.getLogger(__name__)

SHAPES = {  # Qwen2.5's, from their config.json
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
}


def random_model(shape: str, dtype: torch.dtype, device: str) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=shape != "7b", **SHAPES[shape])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def costs(shape: str, device: str, dtype: str, blocks: Sequence[int], prompt: int, repeats: int) -> dict:
    model = random_model(shape, DTYPES[dtype], device)
    out: dict = dict(shape=shape, device=torch.cuda.get_device_name() if device == "cuda" else device, dtype=dtype)
    request = RequestSpec("r", tuple(range(100, 100 + prompt)), SamplingParams(), max_new_tokens=64)
    for how in ("eager", "compiled"):
        options = ModelOptions(compile=how == "compiled", max_width=max(blocks), max_context=prompt + 128)
        began = time.perf_counter()
        stage = CausalLMStage(
            StageSpec("target", "causal_lm", "(random weights)", dtype=dtype, device=device, options=options), model=model
        )
        out[f"{how}_warmup_s"] = time.perf_counter() - began
        out[f"{how}_widths"] = stage.shapes.widths
        if "floor_s" not in out:
            out["parameters"] = sum(w.numel() for w in streamed(stage))
            out["floor_s"] = floor_s(out["parameters"], DTYPES[dtype], repeats, device)
        times = {}
        for k in blocks:
            session = stage.open(request)
            try:
                times[k] = time_forwards(session, k, repeats)[1]
            finally:
                session.close()
            log.info("%s %s: %d tokens %.2f ms", shape, how, k, 1e3 * times[k])
        out[how] = times
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens prefilled before the timed forwards")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parse_logged(parser, argv)
    out = costs(args.shape, args.device, args.dtype, args.blocks, args.prompt, args.repeats)
    floor = out["floor_s"]
    print(f"{args.shape} ({out['parameters'] / 1e9:.2f}B weights read per forward), {args.dtype} on {out['device']}:")
    print(f"median ms per forward after a {args.prompt}-token prompt; (x): over the floor, {1e3 * floor:.2f} ms")
    print(f"{'how':>9} {'warm-up s':>10} {'widths':>10}" + "".join(f"{k:>14}" for k in args.blocks))
    for how in ("eager", "compiled"):
        widths = str(out[how + "_widths"])
        print(f"{how:>9} {out[how + '_warmup_s']:>10.1f} {widths:>10}" + cells(out[how], args.blocks, floor))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
