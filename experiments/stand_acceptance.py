"""STAND against prompt lookup and a tiny drafter: tokens a verification as its memory fills, chains and trees.

    python -m experiments.stand_acceptance [CONFIG] [--drafter tiny] [--limit 16] [--samples 4] [--tokens 96]
        [--width 8] [--temperature 0.7] [--modes greedy rejection] [--out DIR]

STAND (pipespec.stages.stand) keeps, per n-gram context, the target's distributions from earlier commits, one
memory across requests: its setting is many answers to the same questions (test-time scaling), where what one
answer taught helps the next. Synchronous speculation (pipespec.engine.synchronous) answers each of `--limit`
held-out questions `--samples` times (question by question, each with its own seed under sampling) with: prompt
lookup (`ngram`), STAND with a chain and with a tree, and CONFIG's `--drafter` (a model) with a chain and a tree,
all at one target forward width (`--width` rows: w - 1 drafts or nodes; the STAND trees value its probabilities
as they are: temperature 1). A STAND side starts with an empty memory. Reported per side: tokens committed per
target forward over each question's first answer and over its later ones, and the decode throughput of the whole
run (one round: a STAND side's memory changes as it goes, so its rounds would differ; on a shared CPU quote it
as indicative). Every greedy answer is checked token for token against the target alone.

Writes stand_acceptance.json and stand_acceptance.md under --out (default experiments/results/stand).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from experiments.prompt_sets import load_prompts
from experiments.results_files import table, write_results
from experiments.tree_acceptance import DEFAULT_CONFIG, DEFAULT_PROMPTS, Side
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import StageSpec, sub_pipeline, with_stages
from pipespec.engine.stage import Stage
from pipespec.engine.synchronous import SyncResult, generate_sync
from pipespec.protocol.params import SamplingParams, VerifyMode
from pipespec.protocol.tree_shape import TreeShape
from pipespec.schema.kinds import ModelOptions
from pipespec.stages.build import build_stage, load_stages

log = logging.getLogger(__name__)

DEFAULT_OUT = Path("experiments/results/stand")


def modes(temperature: float) -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(),
        f"rejection T={temperature}": SamplingParams(temperature=temperature, verify=VerifyMode.REJECTION),
    }


def run(args: argparse.Namespace) -> list[dict]:
    full = load_config(args.config)
    config = sub_pipeline(full, [args.drafter, full.target.name])
    options = replace(config.target.options or ModelOptions(), max_width=args.width)
    config = with_stages(config, (*config.stages[:-1], replace(config.target, options=options)))
    model, target = load_stages(config)
    weightless: dict[str, Callable[[], Stage]] = {  # built afresh per mode: a STAND memory starts empty
        kind: lambda kind=kind: build_stage(StageSpec(kind, kind), (StageSpec(kind, kind), config.target), target.vocab_size)
        for kind in ("ngram", "stand")
    }
    drafts = args.width - 1
    tree = TreeShape(budget=drafts, depth=drafts, branching=args.branching)
    prompts = load_prompts(args.prompts, limit=args.limit)
    rows = []
    with LocalPipeline(config, stages=[model, target]) as pipe:
        specs = [
            pipe.request(prompt=p.text, max_new_tokens=args.tokens, **({"image": str(p.image)} if p.image else {}))[0]
            for p in prompts
        ]
        for mode, params in modes(args.temperature).items():
            if mode.split()[0] not in args.modes:
                continue
            answers = [  # question by question, `samples` answers each
                replace(s, request_id=f"{s.request_id}-{k}", params=replace(params, seed=i * args.samples + k))
                for i, s in enumerate(specs)
                for k in range(args.samples)
            ]
            alone = [generate_sync(target, s).token_ids for s in answers] if params.greedy else None
            compared = [
                ("ngram chain", weightless["ngram"](), Side("chain", drafts)),
                ("stand chain", weightless["stand"](), Side("chain", drafts)),
                ("stand tree", weightless["stand"](), Side("tree", drafts, tree)),
                (f"{args.drafter} chain", model, Side("chain", drafts)),
                (f"{args.drafter} tree", model, Side("tree", drafts, tree)),
            ]
            for side in (Side("chain", drafts), Side("tree", drafts, tree)):  # the first forwards of each width, unmeasured
                side.run(target, model, answers[0])
            for name, drafter, side in compared:
                rows.append(_row(name, mode, [side.run(target, drafter, s) for s in answers], args.samples, alone))
                log.info("%s", rows[-1])
    return rows


def _row(side: str, mode: str, results: Sequence[SyncResult], samples: int, alone: list[list[int]] | None) -> dict:
    """One side's figures over the answers (question by question, `samples` each)."""
    first = [n for i, r in enumerate(results) if i % samples == 0 for n in r.accept_lengths]
    later = [n for i, r in enumerate(results) if i % samples for n in r.accept_lengths]
    every = first + later
    return {
        "mode": mode,
        "side": side,
        "tokens_per_verification": statistics.fmean(every),
        "first_answers": statistics.fmean(first),
        "later_answers": statistics.fmean(later) if later else None,
        "nodes_per_verification": sum(r.pair.num_draft_tokens for r in results) / len(every),
        "decode_tok_s": sum(len(r.token_ids) - 1 for r in results) / sum(r.decode_s for r in results),
        "exact": "n/a" if alone is None else f"{sum(r.token_ids == a for r, a in zip(results, alone))}/{len(results)}",
    }


def markdown(rows: list[dict], header: str) -> str:
    columns = ["mode", "side", "tokens / verification", "first answers", "later answers", "nodes / verification"]
    columns += ["decode tok/s", "exact"]

    def cells(r: dict) -> list[object]:
        later = "-" if r["later_answers"] is None else f"{r['later_answers']:.2f}"
        numbers = [f"{r['tokens_per_verification']:.2f}", f"{r['first_answers']:.2f}", later]
        return [r["mode"], r["side"], *numbers, f"{r['nodes_per_verification']:.1f}", f"{r['decode_tok_s']:.1f}", r["exact"]]

    return table(header, columns, map(cells, rows))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="pipeline config (its drafter and target)")
    parser.add_argument("--drafter", default="tiny", help="the model drafter to compare with, straight before the target")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prompt file (jsonl, experiments.prompt_sets)")
    parser.add_argument("--limit", type=int, default=16, help="how many questions")
    parser.add_argument("--samples", type=int, default=4, help="answers per question")
    parser.add_argument("--tokens", type=int, default=96, help="most new tokens per answer")
    parser.add_argument("--width", type=int, default=8, help="target forward width (rows: drafts + 1)")
    parser.add_argument("--branching", type=int, default=4, help="the trees' branching (EAGLE-2's top-k)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--modes", nargs="+", default=["greedy", "rejection"], choices=["greedy", "rejection"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (every side the same)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where stand_acceptance.json and .md go")
    args = parse_logged(parser, argv)
    torch.set_num_threads(args.threads)
    began = time.time()
    rows = run(args)
    header = (
        f"# STAND against prompt lookup and {args.drafter} ({args.config}, {args.limit} held-out questions x "
        f"{args.samples} answers, {args.tokens} tokens, width {args.width}, {args.threads} threads; {time.time() - began:.0f} s)"
    )
    write_results(args.out, "stand_acceptance", args, rows, markdown(rows, header))


if __name__ == "__main__":
    main()
