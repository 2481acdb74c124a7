"""Hugging Face `generate` with left-padded batches: the outside reference for batched serving.

    python -m dev.hf_batched [--model models/demo/target] [--prompts FILE] [--batch 1 4 16 64]
                                     [--requests 64] [--max-tokens 96] [--threads 2] [--runs 2]

The demo target loaded as users load it (`AutoModelForImageTextToText.from_pretrained`, its own processor and
chat template, transformers' own attention), greedy. For each batch size B, `--requests` requests (the held-out
questions of the demo world with their pictures, cycled) go through in batches of B, each batch left-padded to
its longest prompt and generated until every row has stopped. Per batch size, the medians over `--runs`:
output tokens per second (each row's tokens up to its end of sequence), the time to a batch's first token (its
prefill) and per output step after it; and how many answers equal that request's at the least B (left padding
changes the arithmetic a row sees: Hugging Face promises no batch invariance). `experiments.bench_http` serves
the same questions through pipespec at the same concurrencies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from experiments.prompt_sets import WORLD_PROMPTS, Prompt, load_prompts
from pipespec.commands.logs import parse_logged


@dataclass(frozen=True)
class BatchRun:
    """One pass of every request at one batch size."""

    tokens: int  # output tokens, every row's up to its end of sequence
    seconds: float
    first_token_s: list[float]  # per batch: from its start to its first generated tokens
    step_s: list[float]  # per batch: seconds per generation step after the first
    answers: list[tuple[int, ...]]  # per request, in order


class _Steps:
    """A `generate` streamer that notes when each step's tokens arrive (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run(model, processor, prompts: list[Prompt], batch: int, max_tokens: int) -> BatchRun:
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    answers, first, steps, tokens = [], [], [], 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        texts = [
            processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p.text}]}], add_generation_prompt=True
            )
            for p in chunk
        ]
        images = []
        for p in chunk:
            with Image.open(p.image) as picture:
                images.append(picture.convert("RGB"))
        inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
        clock = _Steps()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, streamer=clock)
        generated = out[:, inputs["input_ids"].shape[1] :].tolist()  # [rows, steps]
        for row in generated:
            end = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            answers.append(tuple(row[:end]))
            tokens += end
        if len(clock.times) > 1:
            first.append(clock.times[1] - started)
            if len(clock.times) > 2:
                steps.append((clock.times[-1] - clock.times[1]) / (len(clock.times) - 2))
    return BatchRun(tokens, time.perf_counter() - t0, first, steps, answers)


def table(results: dict[int, list[BatchRun]], args: argparse.Namespace) -> str:
    lines = [
        f"Hugging Face `generate`, {args.model}, left-padded batches, greedy, torch threads: {args.threads}, "
        f"{args.requests} requests of {args.prompts.name} (at most {args.max_tokens} tokens), medians of {args.runs} runs:",
        "",
        f"| batch | output tok/s | x batch {min(results)} | first token of a batch (ms) | ms per step after it "
        f"| answers equal to batch {min(results)}'s |",
        "|---|---|---|---|---|---|",
    ]
    base = None
    reference = results[min(results)][0].answers
    for batch, runs in sorted(results.items()):
        tps = statistics.median(r.tokens / r.seconds for r in runs)
        base = base or tps
        first = statistics.median(statistics.median(r.first_token_s) for r in runs)
        steps = [statistics.median(r.step_s) for r in runs if r.step_s]  # none where every answer is one token
        step = f"{1e3 * statistics.median(steps):.1f}" if steps else "-"
        equal = sum(a == b for a, b in zip(runs[0].answers, reference))
        lines.append(f"| {batch} | {tps:.1f} | {tps / base:.2f}x | {1e3 * first:.0f} | {step} | {equal}/{len(reference)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/demo/target", help="an image-text-to-text model directory")
    parser.add_argument("--prompts", type=Path, default=WORLD_PROMPTS, help="an image-question jsonl file")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the table here too")
    args = parse_logged(parser, argv)
    for name in ("requests", "max_tokens", "threads", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: at least 1, got {getattr(args, name)}")
    if min(args.batch) < 1:
        parser.error(f"--batch: every size at least 1, got {min(args.batch)}")
    prompts = load_prompts(args.prompts)
    if any(p.image is None for p in prompts):
        parser.error(f"--prompts: every question needs a picture ({args.prompts})")
    prompts = (prompts * (args.requests // len(prompts) + 1))[: args.requests]
    torch.set_num_threads(args.threads)
    processor = AutoProcessor.from_pretrained(args.model)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32).eval()
    run(model, processor, prompts[: max(args.batch)], max(args.batch), args.max_tokens)  # warm-up
    results: dict[int, list[BatchRun]] = {b: [] for b in sorted(set(args.batch))}
    for _ in range(args.runs):  # the batch sizes alternate within each run
        for batch in results:
            results[batch].append(run(model, processor, prompts, batch, args.max_tokens))
    text = table(results, args)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
