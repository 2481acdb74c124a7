"""Draft trees in the asynchronous pipeline: the stage right before the target offering siblings, against its chain.

    python -m experiments.tree_pipeline [CONFIG] [--chains tiny,target dream,target] [--limit 24] [--calibrate 8]
        [--tokens 96] [--rounds 3] [--out DIR]

For each chain of CONFIG's stages (default: the demo's), the pipeline runs in this process (LocalPipeline:
in-process links, its stages sharing this machine's cores) as a chain and with a `tree` section on the stage
right before the target (budget: the target's widest forward less its root; the drafter's value temperature
fitted on the target's greedy answers to the first `--calibrate` questions, as `pipespec plan` fits it, which the
measurement leaves out), the held-out questions one at a time, greedy, the two sides taking turns each round.
Reported per side: the target's pair's tokens a verification (its mean acceptance length), the nodes a
verification checked, the whole set's tokens per second (the median of the rounds) and whether every answer is
the target alone's.

Writes tree_pipeline.json and tree_pipeline.md under --out (default experiments/results/trees).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from experiments.prompt_sets import Prompt, load_prompts
from experiments.results_files import table, write_results
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import PipelineConfig, config_dict, sub_pipeline
from pipespec.engine.synchronous import generate_sync
from pipespec.planning.profiling import value_temperature
from pipespec.protocol.stats import merged_pairs
from pipespec.schema.kinds import ModelOptions

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "pipespec/configs/demo.yaml"
DEFAULT_PROMPTS = "experiments/prompts/world_held_out.jsonl"
DEFAULT_OUT = Path("experiments/results/trees")


def with_tree(config: PipelineConfig, temperature: float) -> PipelineConfig:
    """`config` with a `tree` section on the stage right before its target, as wide as the target's forwards allow."""
    raw = config_dict(config)
    widest = (config.target.options or ModelOptions()).max_width
    raw["stages"][-2]["tree"] = {"budget": widest - 1, "temperature": temperature}
    return load_config(raw)


def run(full: PipelineConfig, names: Sequence[str], prompts: Sequence[Prompt], args: argparse.Namespace) -> list[dict]:
    if len(names) < 2 or names[-1] != full.target.name:
        raise SystemExit(f"--chains: {','.join(names)} must be drafters, then the target {full.target.name!r}")
    chain = sub_pipeline(full, names)
    with LocalPipeline(chain) as pipe:
        stages = pipe.stages
        requests = [
            dict(prompt=p.text, max_new_tokens=args.tokens, **({"image": str(p.image)} if p.image else {})) for p in prompts
        ]
        drafter, target = stages[-2], stages[-1]
        specs = [pipe.request(**r)[0] for r in requests[: args.calibrate]]
        temperature = value_temperature(drafter, target, specs, chain.sends_features(len(stages) - 1)) if specs else 1.0
        measured = requests[args.calibrate :]
        alone = [generate_sync(target, pipe.request(**r)[0]).token_ids for r in measured]
    sides = {"chain": chain, "tree": with_tree(chain, temperature)}
    runs: dict[str, list[tuple[float, list]]] = {name: [] for name in sides}
    with LocalPipeline(sides["chain"], stages=stages) as chained, LocalPipeline(sides["tree"], stages=stages) as treed:
        pipes = {"chain": chained, "tree": treed}
        for pipe in pipes.values():
            pipe.generate(**{**measured[0], "max_new_tokens": 8})  # warm: its first forwards
        for _ in range(args.rounds):
            for name, pipe in pipes.items():
                began = time.perf_counter()
                generations = [pipe.generate(**r) for r in measured]
                runs[name].append((time.perf_counter() - began, generations))
    rows = []
    for name, side in runs.items():
        seconds, generations = side[0]
        pair = next(p for p in merged_pairs(g.stats.pairs for g in generations) if p.verifier == target.name)
        rates = [sum(len(g.token_ids) for g in gens) / s for s, gens in side]
        rows.append(
            {
                "chain": " -> ".join(names),
                "side": name,
                "value_temperature": temperature if name == "tree" else None,
                "tokens_per_verification": pair.mean_acceptance_length,
                "drafts_per_verification": pair.num_draft_tokens / pair.num_drafts if pair.num_drafts else 0.0,
                "nodes_per_verification": pair.num_nodes / pair.num_drafts if pair.num_drafts else 0.0,
                "tokens_per_s": statistics.median(rates),
                "tokens_per_s_rounds": rates,
                "exact": f"{sum(g.token_ids == want for g, want in zip(generations, alone))}/{len(alone)}",
            }
        )
        log.info("%s", rows[-1])
    return rows


def markdown(rows: list[dict], header: str) -> str:
    columns = ["chain", "side", "tokens / verification", "drafts / verification", "nodes / verification"]
    columns += ["tok/s (median)", "exact"]
    numbers = ("tokens_per_verification", "drafts_per_verification", "nodes_per_verification")
    return table(
        header,
        columns,
        ([r["chain"], r["side"], *(f"{r[k]:.2f}" for k in numbers), f"{r['tokens_per_s']:.1f}", r["exact"]] for r in rows),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="pipeline config (its stages)")
    parser.add_argument("--chains", nargs="+", default=["tiny,target", "dream,target"], help="chains, stage names by commas")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prompt file (jsonl, experiments.prompt_sets)")
    parser.add_argument("--limit", type=int, default=24, help="how many prompts (the first --calibrate of them fit the values)")
    parser.add_argument(
        "--calibrate", type=int, default=8, help="questions that fit the value temperature, left out of the measurement"
    )
    parser.add_argument("--tokens", type=int, default=96, help="most new tokens per answer")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the questions, the sides taking turns")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where tree_pipeline.json and .md go")
    args = parse_logged(parser, argv)
    if not 0 <= args.calibrate < args.limit:
        parser.error(f"--calibrate must be in 0..{args.limit - 1} (--limit), got {args.calibrate}")
    torch.set_num_threads(2)
    full = load_config(args.config)
    prompts = load_prompts(args.prompts, limit=args.limit)
    began = time.time()
    rows = [row for chain in args.chains for row in run(full, chain.split(","), prompts, args)]
    header = (
        f"# Draft trees in the pipeline, in process ({args.config}, {len(prompts) - args.calibrate} held-out questions one at "
        f"a time, {args.tokens} tokens, greedy, {args.rounds} rounds; {time.time() - began:.0f} s)"
    )
    write_results(args.out, "tree_pipeline", args, rows, markdown(rows, header))


if __name__ == "__main__":
    main()
