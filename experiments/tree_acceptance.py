"""Draft trees against chains at the same forward width: tokens a verification, speed, exactness.

    python -m experiments.tree_acceptance [CONFIG] [--drafters tiny dream] [--widths 4 8 16] [--calibrate 8]
        [--limit 24] [--tokens 96] [--temperature 0.7] [--modes greedy coupled rejection] [--seeds 1] [--repeats 3]
        [--out DIR]

For each drafter of CONFIG (default: the demo's) straight before its target, synchronous speculation
(pipespec.engine.synchronous) answers held-out questions with a chain of w - 1 drafts and with a tree of
w - 1 nodes (EAGLE-2's dynamic tree: pipespec.engine.tree_drafting), so both verify in target forwards of w
rows (the target's max_width raised to the widest w). The trees' value temperature is fitted first on the
target's greedy answers to the first `--calibrate` questions (`fit_temperature`), which the measurement leaves
out. Per mode (greedy; coupled sampling; rejection sampling with token-level and with Traversal Verification)
it reports the tokens committed per target forward, mean and per question kind, the nodes a verification
checks, and the decode throughput: each side once unmeasured (its first forwards), then `--repeats` rounds over
the questions, the sides taking turns within a round (throughput: the median of the rounds). Every greedy and
coupled answer is checked token for token against the target alone. Under sampling each question runs with
`--seeds` seeds (a sampled answer's acceptance varies with its seed: more seeds, a steadier mean).

Writes tree_acceptance.json and tree_acceptance.md under --out (default experiments/results/trees).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from experiments.prompt_sets import Prompt, load_prompts
from experiments.results_files import table, write_results
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import sub_pipeline, with_stages
from pipespec.engine.stage import Stage
from pipespec.engine.synchronous import SyncResult, generate_sync
from pipespec.engine.tree_verification import TreeVerify
from pipespec.planning.profiling import value_temperature
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams, VerifyMode
from pipespec.protocol.tree_shape import TreeShape
from pipespec.schema.kinds import ModelOptions
from pipespec.stages.build import load_stages

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "pipespec/configs/demo.yaml"
DEFAULT_PROMPTS = "experiments/prompts/world_held_out.jsonl"
DEFAULT_OUT = Path("experiments/results/trees")


@dataclass(frozen=True)
class Side:
    """One way of drafting: a chain of `gamma` drafts, or a tree of `shape`, verified by `method` under rejection."""

    name: str
    gamma: int
    shape: TreeShape | None = None
    method: TreeVerify = TreeVerify.TRAVERSAL

    def run(self, target: Stage, drafter: Stage, spec: RequestSpec) -> SyncResult:
        return generate_sync(target, spec, drafter, self.gamma, self.shape, self.method)


def sides(width: int, branching: int, temperature: float, rejection: bool) -> list[Side]:
    """The chain and the tree of a forward `width` (and, under rejection, the tree verified token by token)."""
    drafts = width - 1
    tree = TreeShape(budget=drafts, depth=drafts, branching=branching, temperature=temperature)
    out = [Side(f"chain w{width}", drafts), Side(f"tree w{width}", drafts, tree)]
    if rejection:
        out.append(Side(f"tree w{width} token", drafts, tree, TreeVerify.TOKEN))
    return out


def modes(temperature: float) -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(),
        f"coupled T={temperature}": SamplingParams(temperature=temperature, verify=VerifyMode.COUPLED),
        f"rejection T={temperature}": SamplingParams(temperature=temperature, verify=VerifyMode.REJECTION),
    }


def run(config_path: str, drafter_name: str, prompts: Sequence[Prompt], args: argparse.Namespace) -> list[dict]:
    full = load_config(config_path)
    config = sub_pipeline(full, [drafter_name, full.target.name])
    options = replace(config.target.options or ModelOptions(), max_width=max(args.widths))
    config = with_stages(config, (*config.stages[:-1], replace(config.target, options=options)))
    drafter, target = load_stages(config)
    rows = []
    with LocalPipeline(config, stages=[drafter, target]) as pipe:
        specs = [
            pipe.request(prompt=p.text, max_new_tokens=args.tokens, **({"image": str(p.image)} if p.image else {}))[0]
            for p in prompts
        ]
        calibration = specs[: args.calibrate]  # the drafter's value temperature, fitted as `pipespec plan` fits it
        temperature = value_temperature(drafter, target, calibration, config.sends_features(1)) if calibration else 1.0
        log.info("%s: value temperature %.2f (fitted on %d questions)", drafter_name, temperature, args.calibrate)
        measured = specs[args.calibrate :]
        for mode, params in modes(args.temperature).items():
            if mode.split()[0] not in args.modes:
                continue
            seeds = 1 if params.greedy else args.seeds
            mode_specs = [
                replace(s, params=replace(params, seed=i * seeds + k)) for i, s in enumerate(measured) for k in range(seeds)
            ]
            alone = [generate_sync(target, s).token_ids for s in mode_specs]
            for width in args.widths:
                compared = sides(width, args.branching, temperature, params.rejection)
                for side in compared:  # its first forwards (a width compiled), unmeasured
                    side.run(target, drafter, mode_specs[0])
                runs: dict[str, list[list[SyncResult]]] = {side.name: [] for side in compared}
                for _ in range(args.repeats):
                    for side in compared:
                        runs[side.name].append([side.run(target, drafter, s) for s in mode_specs])
                kinds = [p.category for p in prompts[args.calibrate :] for _ in range(len(mode_specs) // len(measured))]
                for side in compared:
                    rows.append(_row(drafter.name, mode, side, width, runs[side.name], kinds, alone, params))
                    log.info("%s", rows[-1])
    return rows


def _row(drafter: str, mode: str, side: Side, width: int, runs: list[list[SyncResult]], kinds: list[str], alone, params) -> dict:
    """One side's figures: tokens a verification from its first round (every round drafts the same), the throughput
    of each round."""
    results = runs[0]
    per_kind: dict[str, list[int]] = defaultdict(list)
    for kind, result in zip(kinds, results):
        per_kind[kind] += result.accept_lengths
    lengths = [n for result in results for n in result.accept_lengths]
    rates = [sum(len(r.token_ids) - 1 for r in run) / sum(r.decode_s for r in run) for run in runs]
    exact = sum(r.token_ids == want for r, want in zip(results, alone))
    return {
        "mode": mode,
        "drafter": drafter,
        "side": side.name,
        "width": width,
        "value_temperature": side.shape.temperature if side.shape else None,
        "tokens_per_verification": statistics.fmean(lengths),
        "per_kind": {k: statistics.fmean(v) for k, v in sorted(per_kind.items())},
        "nodes_per_verification": sum(r.pair.num_draft_tokens for r in results) / len(lengths),
        "decode_tok_s": statistics.median(rates),
        "decode_tok_s_runs": rates,
        "exact": "n/a" if params.rejection else f"{exact}/{len(results)}",
    }


def markdown(rows: list[dict], header: str) -> str:
    columns = ["drafter", "mode", "side", "tokens / verification", "nodes / verification", "decode tok/s (median)"]
    columns += ["exact", "per kind"]

    def cells(r: dict) -> list[object]:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["per_kind"].items())
        numbers = [f"{r['tokens_per_verification']:.2f}", f"{r['nodes_per_verification']:.1f}", f"{r['decode_tok_s']:.1f}"]
        return [r["drafter"], r["mode"], r["side"], *numbers, r["exact"], kinds]

    return table(header, columns, map(cells, rows))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="pipeline config (its drafters and target)")
    parser.add_argument(
        "--drafters", nargs="+", default=["tiny", "dream"], help="the drafters to pair with the target, each alone"
    )
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prompt file (jsonl, experiments.prompt_sets)")
    parser.add_argument(
        "--limit", type=int, default=24, help="how many prompts (the first --calibrate of them fit the trees' values)"
    )
    parser.add_argument(
        "--calibrate", type=int, default=8, help="questions that fit the value temperature, left out of the measurement"
    )
    parser.add_argument("--tokens", type=int, default=96, help="most new tokens per answer")
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8, 16], help="target forward widths (rows: drafts + 1)")
    parser.add_argument("--branching", type=int, default=4, help="the trees' branching (EAGLE-2's top-k)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument(
        "--modes", nargs="+", default=["greedy", "coupled", "rejection"], choices=["greedy", "coupled", "rejection"]
    )
    parser.add_argument("--seeds", type=int, default=1, help="seeds per question under sampling")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the prompts (throughput: their median)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (both sides the same)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where tree_acceptance.json and .md go")
    args = parse_logged(parser, argv)
    if not 0 <= args.calibrate < args.limit:
        parser.error(f"--calibrate must be in 0..{args.limit - 1} (--limit), got {args.calibrate}")
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, limit=args.limit)
    began = time.time()
    rows = [row for name in args.drafters for row in run(args.config, name, prompts, args)]
    header = (
        f"# Trees against chains ({args.config}, {len(prompts) - args.calibrate} held-out questions measured, "
        f"{args.seeds} seed(s) each under sampling, {args.tokens} tokens, {args.threads} threads, {args.repeats} rounds; "
        f"{time.time() - began:.0f} s)"
    )
    write_results(args.out, "tree_acceptance", args, rows, markdown(rows, header))


if __name__ == "__main__":
    main()
