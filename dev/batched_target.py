"""The target alone, batched: output tokens per second with 1 to N requests in flight, on a random Llama shape.

    python -m dev.batched_target [--shape 150m] [--dtype bfloat16] [--concurrency 1 4 16 32] [--runs 3]

A random-weight Llama of one of experiments.agreeing_family's shapes (150m: hidden 768, 12 layers, a
32000-word vocabulary, 162M parameters: a forward reads its 324 MB of bf16 weights, bandwidth-bound on a
CPU), built from its config, saved and loaded back through `from_pretrained` as a causal_lm stage
whose forwards carry up to the largest concurrency's requests (`max_batch`), compiled, on `--threads`
torch threads. At each concurrency c, c greedy requests of `--prompt` random tokens go in at once and
each generates `--tokens`; the figure is the committed tokens over the wall seconds, the median of
`--runs` runs, the concurrencies taking turns within each run. Every answer is compared with the same
prompt's answered alone first: batched steps promise the same tokens. Written to --out as
batched_target.json and batched_target.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from experiments.agreeing_family import SHAPES, llama_config, tokenizer
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import add_log_level, setup_logging

log = logging.getLogger(__name__)


def build(shape: str, out: Path, vocab: int, max_context: int) -> Path:
    """The random model of `shape` with a word tokenizer of `vocab` words, saved under `out`."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(SHAPES[shape], vocab, max_context))
    model.save_pretrained(out)
    tokenizer(vocab).save_pretrained(out)
    return out


def measure(pipe: LocalPipeline, prompts: list[list[int]], tokens: int) -> tuple[float, list[tuple[int, ...]]]:
    """All of `prompts` at once -> (output tokens per second, their answers)."""
    began = time.perf_counter()
    futures = [pipe.submit(prompt_token_ids=p, max_new_tokens=tokens) for p in prompts]
    answers = [tuple(f.result().token_ids) for f in futures]
    return sum(map(len, answers)) / (time.perf_counter() - began), answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="150m", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the target")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/batched_target"))
    add_log_level(parser, default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    vocab, context = 32000, 512
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(max(args.concurrency))]
    rates: dict[int, list[float]] = {c: [] for c in args.concurrency}
    same: dict[int, bool] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build(args.shape, Path(tmp) / args.shape, vocab, context)
        stage = {
            "name": "target", "kind": "causal_lm", "model": str(path), "dtype": args.dtype,
            "max_batch": max(args.concurrency), "compile": args.compile,
        }  # fmt: skip
        with LocalPipeline(load_config({"stages": [stage]}), torch_threads=args.threads) as pipe:
            alone = [measure(pipe, [p], args.tokens)[1][0] for p in prompts]  # each prompt alone: the reference (and a warm-up)
            for run in range(args.runs):
                for c in args.concurrency if run % 2 == 0 else reversed(args.concurrency):
                    rate, answers = measure(pipe, prompts[:c], args.tokens)
                    rates[c].append(rate)
                    same[c] = same.get(c, True) and answers == alone[:c]
                    log.info("run %d, %d in flight: %.1f tok/s", run + 1, c, rate)
    base = statistics.median(rates[min(args.concurrency)])
    result = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch": torch.__version__,
        "rows": [
            {"in_flight": c, "tok_s": statistics.median(r), "runs": r, "x_first": statistics.median(r) / base, "same": same[c]}
            for c, r in rates.items()
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batched_target.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"target alone, random {args.shape} Llama, {args.dtype}, {args.threads} torch threads, "
        f"{'compiled' if args.compile else 'eager'}, {args.tokens} new tokens a request (medians of {args.runs} runs)",
        "",
        "| in flight | output tok/s | x the first | every answer as alone |",
        "|---|---|---|---|",
        *[
            f"| {r['in_flight']} | {r['tok_s']:.1f} | {r['x_first']:.2f} | {'yes' if r['same'] else 'NO'} |"
            for r in result["rows"]
        ],
    ]
    (args.out / "batched_target.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
