"""Draft trees against chains at the same forward width: tokens a verification, speed, exactness.

    python -m experiments.tree_acceptance [CONFIG] [--drafters tiny] [--widths 4 8 16] [--limit 16] [--tokens 96]
        [--temperature 0.7] [--repeats 3] [--out DIR]

For each drafter of CONFIG (default: the demo's) straight before its target, synchronous speculation
(pipespec.engine.synchronous) answers the held-out questions with a chain of w - 1 drafts and with a tree of
w - 1 nodes (EAGLE-2's dynamic tree: pipespec.engine.tree_drafting), so both verify in target forwards of w
rows. Per mode (greedy; coupled sampling; rejection sampling with token-level and with Traversal Verification)
it reports the tokens committed per target forward, mean and per question kind, the nodes a verification
checks, and the decode throughput, the sides alternated question by question over `--repeats` rounds (the
median of the rounds). Every greedy and coupled answer is checked token for token against the target alone.

Writes tree_acceptance.json and tree_acceptance.md under --out (default experiments/results/trees).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from experiments.prompt_sets import Prompt, load_prompts
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import add_log_level, setup_logging
from pipespec.config import sub_pipeline
from pipespec.engine.stage import Stage
from pipespec.engine.synchronous import generate_sync
from pipespec.engine.tree_drafting import TreeShape
from pipespec.engine.tree_verification import TreeVerify
from pipespec.protocol.params import SamplingParams, VerifyMode
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


def sides(width: int, branching: int) -> list[Side]:
    drafts = width - 1
    tree = TreeShape(budget=drafts, depth=drafts, branching=branching)
    return [
        Side(f"chain w{width}", drafts),
        Side(f"tree w{width}", drafts, tree, TreeVerify.TRAVERSAL),
        Side(f"tree w{width} token", drafts, tree, TreeVerify.TOKEN),
    ]


def modes(temperature: float) -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(),
        f"coupled T={temperature}": SamplingParams(temperature=temperature, verify=VerifyMode.COUPLED),
        f"rejection T={temperature}": SamplingParams(temperature=temperature, verify=VerifyMode.REJECTION),
    }


def run(config_path: str, drafter_name: str, prompts: Sequence[Prompt], args: argparse.Namespace) -> list[dict]:
    config = sub_pipeline(load_config(config_path), [drafter_name, load_config(config_path).target.name])
    drafter, target = load_stages(config)
    rows = []
    with LocalPipeline(config, stages=[drafter, target]) as pipe:
        specs = [pipe.request(prompt=p.text, max_new_tokens=args.tokens, **({"image": str(p.image)} if p.image else {}))[0] for p in prompts]
        for mode, params in modes(args.temperature).items():
            mode_specs = [replace(s, params=replace(params, seed=i)) for i, s in enumerate(specs)]
            alone = [generate_sync(target, s).token_ids for s in mode_specs]
            for width in args.widths:
                for side in sides(width, args.branching):
                    if side.method is TreeVerify.TOKEN and not params.rejection:
                        continue  # greedy and coupled verify by exact match: no method to compare
                    rows.append(_measure(drafter, target, prompts, mode_specs, alone, mode, side, width, args.repeats, params))
                    log.info("%s", rows[-1])
    return rows


def _measure(drafter: Stage, target: Stage, prompts, specs, alone, mode: str, side: Side, width: int, repeats: int, params) -> dict:
    per_kind: dict[str, list[int]] = defaultdict(list)
    lengths: list[int] = []
    drafted = 0
    rates = []
    exact = 0
    for _ in range(repeats):
        tokens = seconds = 0.0
        lengths.clear()
        per_kind.clear()
        drafted = 0
        exact = 0
        for prompt, spec, want in zip(prompts, specs, alone):
            result = generate_sync(target, spec, drafter, side.gamma, side.shape, side.method)
            lengths += result.accept_lengths
            per_kind[prompt.category or "all"] += result.accept_lengths
            drafted += result.pair.num_draft_tokens if result.pair else 0
            tokens += len(result.token_ids) - 1
            seconds += result.decode_s
            exact += result.token_ids == want
        rates.append(tokens / seconds)
    return {
        "mode": mode,
        "drafter": drafter.name,
        "side": side.name,
        "width": width,
        "tokens_per_verification": statistics.fmean(lengths),
        "per_kind": {k: statistics.fmean(v) for k, v in sorted(per_kind.items())},
        "nodes_per_verification": drafted / len(lengths),
        "decode_tok_s": statistics.median(rates),
        "decode_tok_s_runs": rates,
        "exact": f"{exact}/{len(specs)}" if not params.rejection else "n/a (rejection: same distribution, not tokens)",
    }


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| drafter | mode | side | tokens / verification | nodes / verification | decode tok/s (median) | exact | per kind |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["per_kind"].items())
        lines.append(
            f"| {r['drafter']} | {r['mode']} | {r['side']} | {r['tokens_per_verification']:.2f} | {r['nodes_per_verification']:.1f} | "
            f"{r['decode_tok_s']:.1f} | {r['exact']} | {kinds} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="pipeline config (its drafters and target)")
    parser.add_argument("--drafters", nargs="+", default=["tiny"], help="the drafters to pair with the target, each alone")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prompt file (jsonl, experiments.prompt_sets)")
    parser.add_argument("--limit", type=int, default=16, help="how many prompts")
    parser.add_argument("--tokens", type=int, default=96, help="most new tokens per answer")
    parser.add_argument("--widths", type=int, nargs="+", default=[8], help="target forward widths (rows: drafts + 1)")
    parser.add_argument("--branching", type=int, default=2, help="the trees' branching (EAGLE-2's top-k)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the prompts (throughput: their median)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (both sides the same)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where tree_acceptance.json and .md go")
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, limit=args.limit)
    began = time.time()
    rows = [row for name in args.drafters for row in run(args.config, name, prompts, args)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tree_acceptance.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    header = (
        f"# Trees against chains ({args.config}, {len(prompts)} held-out questions, {args.tokens} tokens, "
        f"{args.threads} threads, {args.repeats} rounds; {time.time() - began:.0f} s)"
    )
    (args.out / "tree_acceptance.md").write_text(markdown(rows, header))
    print(markdown(rows, header))


if __name__ == "__main__":
    main()
