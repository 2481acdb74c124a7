"""What a step of the demo target's training costs on this machine, against what its arithmetic needs.

    python -m dev.train_cost [--steps 5000] [--batch-size 64] [--rounds 3] [--batches 8] [--eager-only]

`python -m demo.train target` runs `--steps` optimiser steps of `--batch-size` conversations (demo.train's shipped
recipe) in fp32 on the CPU. This times that step (its optimiser, `training.optimiser`, clipping included) on real
batches of the recipe (`demo.train.batches`), in fp32 and
under bf16 autocast, eager and compiled (`torch.compile`), alternating over `--rounds` rounds of `--batches`
batches each (medians), beside what its arithmetic needs: 6 x the parameters the tokens pass through (language
model, projector, head; forward and backward) x the tokens of a batch (padding included), plus attention's, over
the machine's measured matrix-multiply rate in fp32 and in bf16 (2 threads, 1024-square products). It prints, per
variant, the step's milliseconds, its share of that rate, and the recipe's minutes at that pace: the floor a
recipe of that size has here. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from demo import train
from pipespec.commands.logs import parse_logged
from training.optimiser import Optimiser


def matmul_rate(dtype: torch.dtype, n: int = 1024, repeats: int = 20) -> float:
    """FLOP a second of an n x n matrix product in `dtype` on this process's torch threads."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def step_flop(model: torch.nn.Module, tokens: int, width: int) -> float:
    """FLOP of one training step (forward and backward) over `tokens` tokens in rows of `width`: 6 per parameter
    the tokens pass through (the vision tower is frozen and its 10 image tokens a picture are left out) and per
    token, plus the attention scores and their weighted sum."""
    passed = sum(p.numel() for name, p in model.named_parameters() if "vision_tower" not in name and "embed_tokens" not in name)
    text = model.config.text_config
    return 6 * passed * tokens + 12 * text.num_hidden_layers * tokens * width * text.hidden_size


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=train.SHIPPED["target"].steps)
    parser.add_argument("--batch-size", type=int, default=train.SHIPPED["target"].batch)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=8, help="batches a round, each variant")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo's 2-core machine: 2)")
    parser.add_argument("--eager-only", action="store_true", help="leave out the compiled variants (compiling takes minutes)")
    args = parse_logged(parser, argv)
    torch.set_num_threads(args.threads)

    tokenizer = train.load_tokenizer(train.MODELS)
    model, processor = train.build_target(tokenizer)
    model.model.vision_tower.requires_grad_(False)
    rows = train.encode_all(train.conversations(0, 40 * args.batch_size), processor, tokenizer)
    draw = train.batches(rows, args.batch_size, random.Random(0), tokenizer.pad_token_id)
    batches = [next(draw) for _ in range(args.batches)]
    params = [p for p in model.parameters() if p.requires_grad]  # the recipe's optimiser (demo.train.fit's)
    optimiser = Optimiser.adamw(params, 1e-3, args.steps, weight_decay=0.1, warmup_steps=args.steps // 30)
    model.train()

    def step(forward: Callable[..., Any], batch: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor], bf16: bool) -> None:
        ids, pixels, labels = batch
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            logits = forward(input_ids=ids, pixel_values=pixels).logits
        optimiser.update(train.answer_loss(logits.float(), labels))

    variants = {"fp32 (the recipe)": (model, False), "bf16 autocast": (model, True)}
    if not args.eager_only:
        compiled = torch.compile(model, dynamic=True)
        variants |= {"fp32, compiled": (compiled, False), "bf16 autocast, compiled": (compiled, True)}
    for forward, bf16 in variants.values():  # warm up (and compile)
        for batch in batches[:2]:
            step(forward, batch, bf16)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (forward, bf16) in variants.items():
            start = time.perf_counter()
            for batch in batches:
                step(forward, batch, bf16)
            seconds[name].append((time.perf_counter() - start) / len(batches))

    flop = statistics.mean(step_flop(model, ids.numel(), ids.shape[1]) for ids, _, _ in batches)
    rates = {False: matmul_rate(torch.float32), True: matmul_rate(torch.bfloat16)}
    print(
        f"The demo target's training step, batch {args.batch_size}, {args.threads} torch threads: {flop / 1e9:.0f} GFLOP a step; "
        f"matrix products here: fp32 {rates[False] / 1e9:.0f}, bf16 {rates[True] / 1e9:.0f} GFLOP/s. "
        f"The recipe's {args.steps} steps at the floor of those rates: fp32 {args.steps * flop / rates[False] / 60:.0f} min, "
        f"bf16 {args.steps * flop / rates[True] / 60:.0f} min.\n"
    )
    print(f"| variant | ms a step (median of {args.rounds}) | share of the matmul rate | {args.steps} steps |")
    print("|---|---|---|---|")
    for name, (_, bf16) in variants.items():
        s = statistics.median(seconds[name])
        print(f"| {name} | {s * 1e3:.0f} | {flop / s / rates[bf16]:.0%} | {args.steps * s / 60:.0f} min |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
