"""Transport cost: the same pipeline with in-process links and with gRPC streams (127.0.0.1).

Per committed token, wall microseconds, median of --runs runs, for zero-latency mock stages (pure
runtime + transport cost) and for the small random-weight Llamas of experiments.toy_models. Both
variants run in one process on one event loop, so the difference is the cost of the gRPC path
(framing, msgpack, HTTP/2 on loopback), not of separate machines.

    python -m experiments.bench_transport [--runs 3] [--tokens 400]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from pipespec import LocalPipeline, load_config


def per_token_us(config, over_grpc: bool, tokens: int, runs: int, stages=None) -> float:
    samples = []
    with LocalPipeline(config, over_grpc=over_grpc, stages=stages) as p:
        p.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=8)  # warm up
        for run in range(runs):
            t0 = time.perf_counter()
            r = p.generate(prompt_token_ids=[1, 2 + run, 3], max_new_tokens=tokens)
            samples.append((time.perf_counter() - t0) / len(r.token_ids) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args()
    from experiments.toy_models import build_family
    from stages import load_stages

    rows = []
    for k in (1, 2, 3):
        config = load_config({"stages": [{"name": f"m{i}", "kind": "mock", "agreement": 0.8, "vocab_size": 64} for i in range(k)]})
        rows.append((f"mock x{k}, zero latency", per_token_us(config, False, args.tokens, args.runs), per_token_us(config, True, args.tokens, args.runs)))
    with tempfile.TemporaryDirectory() as tmp:
        family = build_family(tmp)
        names = ["tiny", "mid", "target"]
        config = load_config({"stages": [{"name": n, "kind": "causal_lm", "model": str(family[n]), "dtype": "float32"} for n in names]})
        stages = load_stages(config)
        tokens = min(args.tokens, 200)
        rows.append(("toy Llamas tiny->mid->target", per_token_us(config, False, tokens, args.runs, stages), per_token_us(config, True, tokens, args.runs, stages)))
    print(f"Wall microseconds per committed token, median of {args.runs} runs (one process, 127.0.0.1):\n")
    print("| pipeline | in-process links | gRPC streams | gRPC extra per token |")
    print("|---|---|---|---|")
    for name, local, grpc_us in rows:
        print(f"| {name} | {local:.0f} | {grpc_us:.0f} | {grpc_us - local:+.0f} |")


if __name__ == "__main__":
    main()
