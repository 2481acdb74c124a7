"""Engine benchmark: asynchronous pipeline vs synchronous speculation vs the target alone.

Mock stages (emulated models, not real ones) with per-forward latencies (profiles of tiny / middle /
target ms per forward; by default 1 / 8 / 40, a fast drafter, and 4 / 12 / 40, slower drafters)
agree with the stage below at a chosen rate (0.5 / 0.7 / 0.9). The same three models serve every
method: for each profile and rate, side by side in one run, committed tokens per second of the target
alone, of synchronous speculative decoding (best of drafter tiny or middle and window 2 / 4 / 8), and
of the asynchronous pipeline with 2 stages (tiny -> target) and 3 (tiny -> middle -> target), next to
the analytical predictions of ../shared/reference.md (PipeSpec; the sync formula with the measured
per-token acceptance). Each figure is the median of --runs runs. Then the runtime's own cost:
zero-latency mock stages, wall microseconds per committed token, and the host CPU work per token
outside the stages' compute.

    python -m experiments.bench_engine [--runs 3] [--tokens 64] [--json experiments/results/bench_engine.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import add_log_level, setup_logging
from pipespec.engine.synchronous import generate_sync
from pipespec.planning.analytical import pipeline_speedup, sync_speedup
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.protocol.stats import StageStats, merged_pairs, merged_stages
from pipespec.stages.build import load_stages

PROMPTS = [(1, 2, 3), (7, 5, 9, 4), (11, 3)]
SYNC_WINDOWS = (2, 4, 8)


def mock_config(latencies: list[float], agreement: float, lookahead: int, vocab: int = 256):
    stages = [
        {"name": name, "kind": "mock", "agreement": agreement, "latency_ms": lat, "max_lookahead": lookahead, "vocab_size": vocab}
        for name, lat in zip(["tiny", "mid", "target"][-len(latencies) :], latencies)
    ]
    return load_config({"name": "bench", "stages": stages})


def spec(prompt: tuple[int, ...], tokens: int, i: int = 0) -> RequestSpec:
    return RequestSpec(f"bench-{i}", prompt, SamplingParams(), tokens)


def time_sync(target, drafter, tokens: int, gamma: int) -> tuple[float, float]:
    """-> (tokens per second, per-token acceptance alpha) over PROMPTS, one after the other."""
    t0, total, accepted, trials = time.perf_counter(), 0, 0, 0
    for i, prompt in enumerate(PROMPTS):
        r = generate_sync(target, spec(prompt, tokens, i), drafter, gamma)
        total += len(r.token_ids)
        if r.pair:
            accepted, trials = accepted + r.pair.num_accepted_tokens, trials + r.pair.num_accepted_tokens + r.pair.num_rejections
    return total / (time.perf_counter() - t0), accepted / trials if trials else 0.0


@dataclass(frozen=True)
class Timed:
    """One pass of a pipeline over PROMPTS, one prompt after the other."""

    tokens_per_s: float
    alphas: list[float]  # per-token acceptance per stage pair, upstream first
    stages: list[StageStats]  # per stage, summed over the prompts


def time_pipeline(pipe: LocalPipeline, tokens: int) -> Timed:
    """The pipeline over PROMPTS, one after the other: its rate, its pairs' alphas, its stages' statistics."""
    t0, total, stats = time.perf_counter(), 0, []
    for prompt in PROMPTS:
        r = pipe.generate(prompt_token_ids=prompt, max_new_tokens=tokens)
        total += len(r.token_ids)
        stats.append(r.stats)
    wall = time.perf_counter() - t0
    alphas = [p.token_acceptance for p in merged_pairs(s.pairs for s in stats)]
    return Timed(total / wall, alphas, merged_stages(s.stages for s in stats))


def bench_agreement(latencies, agreement, lookahead, tokens, runs) -> dict:
    lat_tiny, lat_mid, lat_target = latencies
    three = mock_config(latencies, agreement, lookahead)
    stages = load_stages(three)
    tiny, mid, target = stages
    # The same tiny model straight in front of the target (it agrees with it about agreement^2).
    two = mock_config([lat_tiny, lat_target], agreement, lookahead)
    two_stages = [tiny, target]
    figures: dict[str, list[float]] = {"target": [], "sync": [], "async2": [], "async3": []}
    alpha: dict[str, list[float]] = {"sync": [], "async2": [], "async3_mid_target": [], "async3_tiny_mid": []}
    best_gamma: list[tuple[str, int]] = []  # (drafter, window) of the best sync run
    with LocalPipeline(two, stages=two_stages) as p2, LocalPipeline(three, stages=stages) as p3:
        candidates = [(d, g) for d in (tiny, mid) for g in SYNC_WINDOWS]
        for run in range(runs):
            figures["target"].append(time_sync(target, None, tokens, 0)[0])
            # every drafter and window on the first run; then the best one only
            sync = {(d.name, g): time_sync(target, d, tokens, g) for d, g in candidates}
            best = max(sync, key=lambda k: sync[k][0])
            if run == 0:
                candidates = [(d, g) for d, g in candidates if (d.name, g) == best]
            best_gamma.append(best)
            figures["sync"].append(sync[best][0])
            alpha["sync"].append(sync[best][1])
            two_timed = time_pipeline(p2, tokens)
            figures["async2"].append(two_timed.tokens_per_s)
            (a2,) = two_timed.alphas
            alpha["async2"].append(a2)
            three_timed = time_pipeline(p3, tokens)
            figures["async3"].append(three_timed.tokens_per_s)
            a_tm, a_mt = three_timed.alphas
            alpha["async3_tiny_mid"].append(a_tm)
            alpha["async3_mid_target"].append(a_mt)
    med = {k: statistics.median(v) for k, v in figures.items()}
    alpha_med = {k: statistics.median(v) for k, v in alpha.items()}
    base = 1000.0 / lat_target
    name, gamma = max(set(best_gamma), key=best_gamma.count)
    c = (lat_tiny if name == "tiny" else lat_mid) / lat_target
    return {
        "latencies_ms": list(latencies),
        "agreement": agreement,
        "tokens_per_s": med,
        "acceptance_rate": alpha_med,
        "sync_best": f"{name}, window {gamma}",
        "predicted_tokens_per_s": {
            "target": base,
            "sync": base * sync_speedup(alpha_med["sync"], gamma, c),
            "async2": base * pipeline_speedup(alpha_med["async2"], lookahead),
            "async3": base * pipeline_speedup(alpha_med["async3_mid_target"], lookahead),
        },
    }


def bench_overhead(tokens: int = 1500, runs: int = 3) -> list[dict]:
    """Zero-latency mock stages: wall microseconds per committed token, and the host CPU work per token
    outside the stages' compute (event loops, messages, bookkeeping, coordinator, all stages summed)."""
    rows = []
    for k in (1, 2, 3):
        config = load_config(
            {
                "stages": [
                    {"name": f"m{i}", "kind": "mock", "agreement": 1.0, "vocab_size": 32, "max_lookahead": 8} for i in range(k)
                ]
            }
        )
        walls, hosts = [], []
        with LocalPipeline(config) as p:
            p.generate(prompt_token_ids=[1, 2], max_new_tokens=50)  # warm up
            for _ in range(runs):
                t0, cpu0 = time.perf_counter(), time.process_time()
                r = p.generate(prompt_token_ids=[1, 2], max_new_tokens=tokens)
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                walls.append(wall / tokens * 1e6)
                # CPU time of every thread of the process, minus the stages' model + choice time
                hosts.append((cpu - sum(s.compute_s for s in r.stats.stages)) / tokens * 1e6)
        rows.append({"stages": k, "wall_us_per_token": statistics.median(walls), "host_us_per_token": statistics.median(hosts)})
    return rows


def markdown(results: list[dict], overhead: list[dict], lookahead, tokens, runs) -> str:
    lines = [
        f"Mock stages (emulated latencies), greedy, {len(PROMPTS)} prompts x {tokens} tokens, drafters' lookahead {lookahead} "
        f"(verify window {max(1, lookahead // 2)}), median of {runs} runs. tok/s measured (predicted).",
        "",
        "| latency ms tiny/mid/target | agreement | target alone | sync SD (best drafter, window) | async 2-stage | async 3-stage | async2 / sync | async3 / target | alpha tiny->target (2-stage) | alpha mid->target (3-stage) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m, p, a = r["tokens_per_s"], r["predicted_tokens_per_s"], r["acceptance_rate"]
        lines.append(
            f"| {' / '.join(f'{x:g}' for x in r['latencies_ms'])} | {r['agreement']:.1f} | {m['target']:.1f} ({p['target']:.1f}) | {m['sync']:.1f} ({p['sync']:.1f}; {r['sync_best']}) "
            f"| {m['async2']:.1f} ({p['async2']:.1f}) | {m['async3']:.1f} ({p['async3']:.1f}) "
            f"| {m['async2'] / m['sync']:.2f}x | {m['async3'] / m['target']:.2f}x | {a['async2']:.2f} | {a['async3_mid_target']:.2f} |"
        )
    lines += ["", "Runtime cost, zero-latency mock stages (vocabulary 32), median of 3 runs of 1500 tokens:", ""]
    lines += ["| stages | wall us / committed token | host CPU us / token outside stage compute (all threads) |", "|---|---|---|"]
    lines += [f"| {o['stages']} | {o['wall_us_per_token']:.0f} | {o['host_us_per_token']:.0f} |" for o in overhead]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--profiles", nargs="+", default=["1,8,40", "4,12,40"], help="tiny,mid,target ms per forward")
    parser.add_argument("--agreements", default="0.5,0.7,0.9")
    parser.add_argument("--lookahead", type=int, default=16, help="drafters' max_lookahead (verify window: half)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    add_log_level(parser)
    args = parser.parse_args()
    setup_logging(args.log_level)
    results = []
    for profile in args.profiles:
        latencies = [float(x) for x in profile.split(",")]
        for a in (float(x) for x in args.agreements.split(",")):
            print(f"latencies {profile} ms, agreement {a} ...", flush=True)
            results.append(bench_agreement(latencies, a, args.lookahead, args.tokens, args.runs))
    overhead = bench_overhead()
    print(markdown(results, overhead, args.lookahead, args.tokens, args.runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": results, "overhead": overhead}, indent=2))


if __name__ == "__main__":
    main()
