"""Engine benchmark: asynchronous pipeline vs synchronous speculation vs the target alone.

Mock stages (emulated models, not real ones) with per-forward latencies (default 1 / 8 / 40 ms: a
tiny drafter, a middle drafter, a target) agree with the stage below at a chosen rate. For each rate,
side by side in one run: committed tokens per second of the target alone, of synchronous speculative
decoding with the same tiny drafter (best window of 2 / 4 / 8), and of the asynchronous pipeline with
2 and 3 stages, next to the analytical predictions of ../shared/reference.md (PipeSpec). Each figure is
the median of --runs runs. Then the runtime's own cost: zero-latency mock stages, microseconds of
wall time per committed token, and how much of it is spent outside the stages' compute.

    python -m experiments.bench_engine [--runs 3] [--tokens 96] [--json experiments/results/bench_engine.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from experiments.analytical import pipeline_speedup, sync_speedup
from pipespec import LocalPipeline, load_config
from pipespec.messages import RequestSpec
from pipespec.params import SamplingParams
from pipespec.synchronous import generate_sync
from stages import load_stages

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


def time_pipeline(pipe: LocalPipeline, tokens: int) -> tuple[float, list[float]]:
    """-> (tokens per second, per-token acceptance alpha per stage pair) over PROMPTS, one after the other."""
    t0, total, pairs = time.perf_counter(), 0, None
    for prompt in PROMPTS:
        r = pipe.generate(prompt_token_ids=prompt, max_new_tokens=tokens)
        total += len(r.token_ids)
        if pairs is None:
            pairs = r.stats.pairs
        else:
            for mine, theirs in zip(pairs, r.stats.pairs):
                mine.merge(theirs)
    return total / (time.perf_counter() - t0), [p.token_acceptance for p in pairs]


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
    best_gamma: list[int] = []
    with LocalPipeline(two, stages=two_stages) as p2, LocalPipeline(three, stages=stages) as p3:
        for _ in range(runs):
            figures["target"].append(time_sync(target, None, tokens, 0)[0])
            sync = {(d.name, g): (d, time_sync(target, d, tokens, g)) for d in (tiny, mid) for g in SYNC_WINDOWS}
            best = max(sync, key=lambda k: sync[k][1][0])
            best_gamma.append(best)
            drafter, (tps, a) = sync[best]
            figures["sync"].append(tps)
            alpha["sync"].append(a)
            tps, (a2,) = time_pipeline(p2, tokens)
            figures["async2"].append(tps)
            alpha["async2"].append(a2)
            tps, (a_tm, a_mt) = time_pipeline(p3, tokens)
            figures["async3"].append(tps)
            alpha["async3_tiny_mid"].append(a_tm)
            alpha["async3_mid_target"].append(a_mt)
    med = {k: statistics.median(v) for k, v in figures.items()}
    alpha_med = {k: statistics.median(v) for k, v in alpha.items()}
    base = 1000.0 / lat_target
    name, gamma = max(set(best_gamma), key=best_gamma.count)
    c = (lat_tiny if name == "tiny" else lat_mid) / lat_target
    return {
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
        config = load_config({"stages": [{"name": f"m{i}", "kind": "mock", "agreement": 1.0, "vocab_size": 32, "max_lookahead": 8} for i in range(k)]})
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


def markdown(results: list[dict], overhead: list[dict], latencies, lookahead, tokens, runs) -> str:
    lines = [
        f"Mock stages (emulated latency {latencies[0]:g} / {latencies[1]:g} / {latencies[2]:g} ms per forward), greedy, "
        f"{len(PROMPTS)} prompts x {tokens} tokens, lookahead {lookahead}, median of {runs} runs. tok/s measured (predicted).",
        "",
        "| agreement | target alone | sync SD (best drafter, window) | async 2-stage | async 3-stage | async2 / sync | async3 / target | alpha tiny->target (2-stage) | alpha mid->target (3-stage) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m, p, a = r["tokens_per_s"], r["predicted_tokens_per_s"], r["acceptance_rate"]
        lines.append(
            f"| {r['agreement']:.1f} | {m['target']:.1f} ({p['target']:.1f}) | {m['sync']:.1f} ({p['sync']:.1f}; {r['sync_best']}) "
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
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--latencies", default="1,8,40", help="tiny,mid,target ms per forward")
    parser.add_argument("--agreements", default="0.5,0.7,0.9")
    parser.add_argument("--lookahead", type=int, default=16, help="drafters' max_lookahead (verify window: half)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    latencies = [float(x) for x in args.latencies.split(",")]
    results = []
    for a in (float(x) for x in args.agreements.split(",")):
        print(f"agreement {a} ...", flush=True)
        results.append(bench_agreement(latencies, a, args.lookahead, args.tokens, args.runs))
    overhead = bench_overhead()
    print(markdown(results, overhead, latencies, args.lookahead, args.tokens, args.runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": results, "overhead": overhead}, indent=2))


if __name__ == "__main__":
    main()
