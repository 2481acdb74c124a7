"""The shipped demo models on held-out pictures, greedy: every way of running them, side by side, in one run.

    python -m experiments.bench_demo [--prompts 12] [--max-new-tokens 96] [--json experiments/results/bench_demo.json]

In one process, with torch on both cores: the target alone, and synchronous speculative decoding
(Leviathan et al.) with the DREAM drafter and with the tiny drafter (`pipespec.synchronous`, the
same stages). On a local Ray, one actor per stage linked by gRPC streams, as `pipespec demo` runs:
the target alone, the 2-stage pipeline (dream -> target) and the 3-stage pipeline (tiny -> dream ->
target). For each: tokens per second over all prompts, the speedup over the in-process target alone,
the mean acceptance length of each stage pair, and whether every answer equals the target alone's.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from cluster.demo import DEMO_MODELS, demo_config, time_requests
from cluster.pipeline import ray_env
from experiments.train_demo import IMAGE_SIZE
from experiments.world import examples, render
from pipespec import LocalPipeline
from pipespec.stats import PairStats
from pipespec.synchronous import generate_sync


def merged(pairs: list[PairStats]) -> dict:
    """One pair's statistics summed over requests -> mean acceptance length."""
    drafts = sum(p.num_drafts for p in pairs)
    accepted = sum(p.num_accepted_tokens for p in pairs)
    return {"num_drafts": drafts, "num_accepted_tokens": accepted, "mean_acceptance_length": 1 + accepted / max(drafts, 1)}


def in_process(models: Path, dtype: str, requests: list[dict]) -> tuple[dict, list[list[int]]]:
    """Target alone and synchronous speculation, in this process; -> (rows, the target's answers)."""
    torch.set_num_threads(2)
    pipe = LocalPipeline(demo_config(models, ["tiny", "dream", "target"], dtype, 1), torch_threads=None)  # never started:
    tiny, dream, target = pipe.stages  # its stages, loaded once, and its front door
    specs = [pipe.request(r["prompt"], image=r["image"], max_new_tokens=r["max_new_tokens"])[0] for r in requests]
    reference = None
    rows = {}
    for name, drafter in (("target alone (in process)", None), ("sync: dream -> target", dream), ("sync: tiny -> target", tiny)):
        generate_sync(target, specs[0], drafter, gamma=4)  # warm up
        t0 = time.perf_counter()
        results = [generate_sync(target, spec, drafter, gamma=4) for spec in specs]
        seconds = time.perf_counter() - t0
        tokens = [r.token_ids for r in results]
        reference = reference or tokens
        rows[name] = {
            "tokens_per_second": sum(map(len, tokens)) / seconds,
            "exact": tokens == reference,
            "pairs": {f"{drafter.name}->target": merged([r.pair for r in results])} if drafter else {},
        }
    return rows, reference


def on_ray(models: Path, dtype: str, requests: list[dict], reference: list[list[int]]) -> dict:
    import ray

    ray_env()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    rows = {}
    try:
        for name, names, cpus in (
            ("target alone (Ray)", ["target"], 2),
            ("async: dream -> target", ["dream", "target"], 1),
            ("async: tiny -> dream -> target", ["tiny", "dream", "target"], 2 / 3),
        ):
            timed = time_requests(demo_config(models, names, dtype, cpus), requests)
            seconds = sum(s for _, s in timed)
            generations = [g for g, _ in timed]
            pairs = {}
            for i in range(len(names) - 1):
                pairs[f"{names[i]}->{names[i + 1]}"] = merged([g.stats.pairs[i] for g in generations])
            rows[name] = {
                "tokens_per_second": sum(len(g.token_ids) for g in generations) / seconds,
                "exact": [g.token_ids for g in generations] == reference,
                "pairs": pairs,
            }
    finally:
        ray.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=DEMO_MODELS)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("experiments/results/bench_demo.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    held_out = examples("held_out", args.prompts, seed=args.seed)
    requests = [dict(prompt=ex.prompt, image=render(ex.scene, IMAGE_SIZE), max_new_tokens=args.max_new_tokens) for ex in held_out]
    rows, reference = in_process(args.models, args.dtype, requests)
    rows.update(on_ray(args.models, args.dtype, requests, reference))
    base = rows["target alone (in process)"]["tokens_per_second"]
    print(f"{len(requests)} held-out prompts, greedy, up to {args.max_new_tokens} new tokens, {args.dtype}")
    print(f"{'configuration':<34}{'tok/s':>8}{'speedup':>9}{'exact':>7}  mean acceptance length")
    for name, row in rows.items():
        row["speedup_vs_target"] = row["tokens_per_second"] / base
        taus = ", ".join(f"{k} {v['mean_acceptance_length']:.2f}" for k, v in row["pairs"].items())
        print(
            f"{name:<34}{row['tokens_per_second']:>8.1f}{row['speedup_vs_target']:>8.2f}x{'yes' if row['exact'] else 'NO':>7}  {taus}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
