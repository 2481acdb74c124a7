"""Choosing the demo target's shape by measurement: what a forward costs, and what the model learns in the budget.

    python -m dev.demo_shapes costs [--shapes 256x24 384x4 384x8 512x4] [--tiny 192x2 128x1] [--json FILE]
    python -m dev.demo_shapes accuracy --shape 384x4 [--minutes 30] [--steps 2000] [--batch-size 64]
        [--workers N] [--keep DIR] [--json FILE]

`costs` builds each candidate shape (HIDDENxLAYERS, 64-wide heads) with random weights (a forward's cost
does not depend on the weights' values): the LLaVA-class target over the demo's tower (`demo.train.
build_target`), a DREAM drafter at its width (`init_from_target`), and the tiny text drafters. Each loads
through its stage kind, compiled as a pipeline runs it, at one torch thread (a device's), and times a
1-token and a 4-token forward after the example picture's prefill (`pipespec.planning.profiling.
time_forwards`). The ratio that matters: the target's forward over the tiny drafter's (the issue asks 4x).

`accuracy` trains one shape's target with the shipped recipe's tower and schedule under the given
budget (into a scratch directory, never over models/demo; `--keep` copies the target out) and scores it per
kind (`demo.evaluate`). On this 2-core CPU, 256x4 runs 3200 steps at batch 64 in about 31 minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from demo.train import MODELS, build_target, llama_config, load_tokenizer
from pipespec.commands.logs import add_log_level, setup_logging

log = logging.getLogger(__name__)

REPEATS = 15


def parse_shape(text: str) -> dict[str, int]:
    """ "384x4" -> TARGET-style sizes: 64-wide heads, an MLP of about 2.75x the width (a multiple of 64)."""
    try:
        hidden, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is HIDDENxLAYERS (e.g. 384x4), not {text!r}") from None
    if hidden % 64 or hidden <= 0 or layers <= 0:
        raise argparse.ArgumentTypeError(f"shape {text!r}: the width must be a positive multiple of 64 and layers positive")
    return dict(hidden=hidden, layers=layers, heads=hidden // 64, intermediate=64 * round(2.75 * hidden / 64))


def _write_models(root: Path, target_shape: dict[str, int], tiny_shapes: dict[str, dict[str, int]]) -> None:
    from transformers import LlamaForCausalLM

    from pipespec.stages.dream.checkpoint import init_from_target, save

    tokenizer = load_tokenizer(MODELS)
    target, processor = build_target(tokenizer, 0, target_shape)
    target.save_pretrained(root / "target")
    processor.save_pretrained(root / "target")
    save(root / "dream", init_from_target(target), tokenizer)
    for name, shape in tiny_shapes.items():
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(tokenizer, shape, tie_word_embeddings=True)).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)


def stage_costs(target_shape: dict[str, int], tiny_shapes: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    """{stage name: {"one_ms", "four_ms"}} of each tiny drafter, the DREAM drafter and the target, compiled, one thread."""
    from pipespec.config import load_config
    from pipespec.local import LocalPipeline
    from pipespec.planning.profiling import open_session, time_forwards
    from pipespec.schema.kinds import kind_of

    root = Path(tempfile.mkdtemp(prefix="demo_shapes_"))
    try:
        _write_models(root, target_shape, tiny_shapes)
        stages = [{"name": n, "kind": "causal_lm", "model": str(root / n), "max_lookahead": 6} for n in tiny_shapes]
        stages += [{"name": "dream", "kind": "dream", "model": str(root / "dream"), "max_lookahead": 6}]
        stages += [{"name": "target", "kind": "vlm", "model": str(root / "target")}]
        costs: dict[str, dict[str, float]] = {}
        for drafter in stages[:-1]:  # a chain of one drafter and the target at a time (a config holds one tiny)
            config = load_config({"name": "shapes", "stages": [drafter, stages[-1]]})
            pipeline = LocalPipeline(config, torch_threads=1)  # loads the stages; never started
            spec, _ = pipeline.request("Describe the image.", image=MODELS / "example.png", max_new_tokens=64, temperature=0.0)
            for j, stage in enumerate(config.stages):
                if stage.name in costs:
                    continue
                reads = kind_of(stage).reads_target_features
                session = open_session(pipeline.stages[j], pipeline.stages[-1], spec, reads)
                try:
                    one, four = time_forwards(session, 4, REPEATS)
                finally:
                    session.close()
                costs[stage.name] = {"one_ms": one * 1e3, "four_ms": four * 1e3}
                log.info("%s: %.2f ms a token, %.2f ms for 4", stage.name, one * 1e3, four * 1e3)
        return costs
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    costs = sub.add_parser("costs", help="compiled forward costs of candidate shapes against the drafters")
    costs.add_argument(
        "--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in ("256x24", "384x4", "384x8", "512x4")]
    )
    costs.add_argument("--tiny", nargs="+", default=["192x2"], help="tiny drafter shapes (HIDDENxLAYERS)")
    accuracy = sub.add_parser("accuracy", help="train one shape's target in the budget and score it per kind")
    accuracy.add_argument("--shape", type=parse_shape, required=True)
    accuracy.add_argument("--minutes", type=float, default=30.0)
    accuracy.add_argument("--steps", type=int, default=2000)
    accuracy.add_argument("--batch-size", type=int, default=64, help="conversations a step (the shipped recipe's: 64)")
    accuracy.add_argument("--workers", type=int, default=os.cpu_count(), help="processes that encode the conversations")
    accuracy.add_argument("--per-kind", type=int, default=40)
    accuracy.add_argument("--keep", type=Path, help="copy the trained target here (default: deleted with its scratch directory)")
    for p in (costs, accuracy):
        p.add_argument("--json", type=Path, help="append the result to this JSON list")
        add_log_level(p, default="INFO")
    args = parser.parse_args(argv)
    if args.what == "accuracy":
        for flag, value in (("--batch-size", args.batch_size), ("--workers", args.workers), ("--steps", args.steps)):
            if value < 1:
                parser.error(f"{flag} {value}: at least 1")
    setup_logging(args.log_level, fmt="%(message)s")
    rows = []
    if args.what == "costs":
        tiny = {f"tiny_{s}": parse_shape(s) for s in args.tiny}
        for shape in args.shapes:
            ms = stage_costs(shape, tiny)
            row = {"shape": shape, "costs": ms}
            row["target_over"] = {n: ms["target"]["one_ms"] / ms[n]["one_ms"] for n in ms if n != "target"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    else:
        rows.append(
            train_and_score(args.shape, args.minutes, args.steps, args.batch_size, args.workers, args.per_kind, args.keep)
        )
        print(json.dumps(rows[-1], indent=1), flush=True)
    if args.json:
        old = json.loads(args.json.read_text()) if args.json.is_file() else []
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(old + rows, indent=1) + "\n")


def train_and_score(
    shape: dict[str, int], minutes: float, steps: int, batch_size: int, workers: int, per_kind: int, keep: Path | None = None
) -> dict:
    """Train `shape`'s target (seed 0, `batch_size` conversations a step) over the shipped tower, in a scratch
    copy of the tokenizer's and the tower's directories; -> {"shape", "minutes", "steps", "batch_size",
    "seconds", "final_loss", "accuracy": {kind: accuracy}, "interval_95": {kind: [low, high]}}."""
    from demo.evaluate import evaluate_target
    from demo.train import train_target

    root = Path(tempfile.mkdtemp(prefix="demo_shape_"))
    try:
        for part in ("tokenizer", "tower"):  # the shipped tokenizer and pretrained tower, shared by every candidate
            shutil.copytree(MODELS / part, root / part)
        start = time.monotonic()
        out = train_target(root, minutes, steps, batch_size, 0, shape=shape, workers=workers)
        seconds = time.monotonic() - start
        curve = json.loads((out / "loss_curve.json").read_text())
        report = evaluate_target(root, per_kind, 0)
        if keep is not None:
            shutil.copytree(out, keep, dirs_exist_ok=True)
        return {
            "shape": shape, "minutes": minutes, "steps": len(curve), "batch_size": batch_size, "seconds": round(seconds),
            "final_loss": sum(curve[-50:]) / len(curve[-50:]), "accuracy": {k: v["accuracy"] for k, v in report.items()},
            "interval_95": {k: v["interval_95"] for k, v in report.items()},
        }  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
