"""Transport cost: the same pipeline with in-process links, with gRPC streams in one process, and
with every stage in its own Ray actor (process) talking gRPC over 127.0.0.1, reached by a Client.

Per committed token, wall microseconds, median of --runs runs, for zero-latency mock stages (pure
runtime + transport cost) and for the small random-weight Llamas of tests.fixtures.toy_models. The
in-process and one-process-gRPC columns share one event loop, so their difference is the cost of the
gRPC path itself (framing, msgpack, HTTP/2 on loopback); the Ray column adds process hops and lets
stages run in parallel (here on 2 cores).

    python -m experiments.bench_transport [--runs 3] [--tokens 400] [--no-ray]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack

from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import add_log_level, setup_logging


def per_token_us(config, over_grpc: bool, tokens: int, runs: int, stages=None) -> float:
    samples = []
    with LocalPipeline(config, over_grpc=over_grpc, stages=stages) as p:
        p.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=8)  # warm up
        for run in range(runs):
            t0 = time.perf_counter()
            r = p.generate(prompt_token_ids=[1, 2 + run, 3], max_new_tokens=tokens)
            samples.append((time.perf_counter() - t0) / len(r.token_ids) * 1e6)
    return statistics.median(samples)


def ray_per_token_us(config, tokens: int, runs: int) -> float:
    from pipespec import Client
    from pipespec.cluster.pipeline import start_pipeline

    running = start_pipeline(config, port=0)
    try:
        client = Client(running.address)
        client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=8)
        samples = []
        for run in range(runs):
            t0 = time.perf_counter()
            r = client.generate(prompt_token_ids=[1, 2 + run, 3], max_new_tokens=tokens)
            samples.append((time.perf_counter() - t0) / len(r.token_ids) * 1e6)
        return statistics.median(samples)
    finally:
        running.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray column")
    add_log_level(parser)
    args = parser.parse_args()
    setup_logging(args.log_level)
    with ExitStack() as stack:
        if not args.no_ray:
            from pipespec.cluster.pipeline import local_ray

            stack.enter_context(local_ray(2))
        rows = measure(args)
    print(f"Wall microseconds per committed token, median of {args.runs} runs, 127.0.0.1, 2 cores:\n")
    print("| pipeline | in-process links | gRPC streams, one process | Ray actors + gRPC + Client |")
    print("|---|---|---|---|")
    for name, local, grpc_us, ray_us in rows:
        print(f"| {name} | {local:.0f} | {grpc_us:.0f} ({grpc_us - local:+.0f}) | {ray_us:.0f} ({ray_us - local:+.0f}) |")


def measure(args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    """-> [(pipeline, in-process us, one-process gRPC us, Ray us)] per committed token."""
    from pipespec.stages.build import load_stages
    from tests.fixtures.toy_models import build_family

    def in_ray(config, tokens):
        return float("nan") if args.no_ray else ray_per_token_us(config, tokens, args.runs)

    rows = []
    for k in (1, 2, 3):
        stages = [
            {"name": f"m{i}", "kind": "mock", "agreement": 0.8, "vocab_size": 64, "resources": {"num_cpus": 0.5}}
            for i in range(k)
        ]
        config = load_config({"name": f"mock{k}", "stages": stages})
        local, grpc_us = per_token_us(config, False, args.tokens, args.runs), per_token_us(config, True, args.tokens, args.runs)
        rows.append((f"mock x{k}, zero latency", local, grpc_us, in_ray(config, args.tokens)))
    with tempfile.TemporaryDirectory() as tmp:
        family = build_family(tmp)
        names = ["tiny", "mid", "target"]
        cpus = {"tiny": 0.5, "mid": 0.5, "target": 1}
        config = load_config(
            {
                "name": "toy",
                "stages": [
                    {
                        "name": n,
                        "kind": "causal_lm",
                        "model": str(family[n]),
                        "dtype": "float32",
                        "resources": {"num_cpus": cpus[n]},
                    }
                    for n in names
                ],
            }
        )
        stages = load_stages(config)
        tokens = min(args.tokens, 200)
        local, grpc_us = (
            per_token_us(config, False, tokens, args.runs, stages),
            per_token_us(config, True, tokens, args.runs, stages),
        )
        rows.append(("toy Llamas tiny->mid->target (fp32)", local, grpc_us, in_ray(config, tokens)))
    return rows


if __name__ == "__main__":
    main()
