"""Host work per target step at each depth: what the runtime does besides the forwards, on the emulated chain.

    python -m dev.host_work [--time-scale 0.03] [--predraft 0] [--requests 1] [--rounds 3] [--tokens 64] [--over-grpc]

For d = 1 .. 4, the last d models of experiments.scaling's CHAIN (mock stages, not real models, in this process:
`LocalPipeline`, one event loop for every stage and the coordinator, a compute thread per stage) generate over
experiments.bench_engine's PROMPTS, one prompt after the other (`--requests` of each in flight at once, a token
apart), `--rounds` times, after one warm-up request, with the trace on (pipespec.engine.trace); `--over-grpc`: each
stage behind its own gRPC server, the links real streams (still one process and one loop). Per depth, per target
step (the target's forwards):

- messages: the deliveries the stages' runners handled (Drafts, Verdicts, finished forwards, timers' wake-ups; a
  frame's several messages are one; the trace's count), and the event loop's CPU milliseconds (the loop thread's CPU clock: every runner's handling, the
  scheduler's planning, the links, the coordinator and the client's stream);
- the process's CPU milliseconds (every thread: the loop, the compute threads' arithmetic and choices, which stand
  in for a device's work here, and their hand-offs), beside the machine's: its cores times the wall time of a target
  step, what the process could use at most;
- tokens per second on the emulated clock (wall rate x time scale);
- and per committed token, the event loop's CPU microseconds (what batched steps' one frame per step must cut
  as requests grow).

Unix only (a thread's CPU clock: `time.pthread_getcpuclockid`). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from dataclasses import dataclass

from experiments.bench_engine import PROMPTS
from experiments.scaling import CHAIN, emulated_config
from pipespec import LocalPipeline
from pipespec.commands.logs import parse_logged


@dataclass(frozen=True)
class Depth:
    """One depth's rounds, per target step (medians over rounds)."""

    chain: str
    target_steps: int  # in all rounds
    messages: float
    loop_ms: float
    process_ms: float
    machine_ms: float  # cores x wall seconds per target step
    tokens_per_s: float  # emulated clock
    loop_us_per_token: float  # the event loop's CPU microseconds per committed token


def thread_cpu_s(ident: int) -> float:
    """CPU seconds of one thread of this process (`threading.Thread.ident`)."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(
    depth: int,
    time_scale: float,
    predraft: int,
    requests: int,
    rounds: int,
    tokens: int,
    max_batch: int = 1,
    over_grpc: bool = False,
) -> Depth:
    base = emulated_config(CHAIN[-depth:], time_scale, lookahead=8, predraft=predraft, max_batch=max_batch)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_round: list[tuple[float, float, float, float, float]] = []
    steps_total = 0
    with LocalPipeline(base, over_grpc=over_grpc) as pipe:
        pipe.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=tokens)  # warm-up
        loop_id = pipe.thread.ident
        for _ in range(rounds):
            pipe.start_trace()
            loop0, cpu0, t0 = thread_cpu_s(loop_id), process_cpu_s(), time.perf_counter()
            generated = 0
            for prompt in PROMPTS:  # `requests` at once, each a token apart
                futures = [pipe.submit(prompt_token_ids=[*prompt, i], max_new_tokens=tokens) for i in range(requests)]
                generated += sum(len(f.result().token_ids) for f in futures)
            wall, loop_s, cpu_s = time.perf_counter() - t0, thread_cpu_s(loop_id) - loop0, process_cpu_s() - cpu0
            summaries = pipe.stop_trace()
            steps = summaries[-1]["steps"] - summaries[-1]["prefills"]
            steps_total += steps
            messages = sum(s["messages"] for s in summaries)
            per_round.append(
                (
                    messages / steps,
                    1e3 * loop_s / steps,
                    1e3 * cpu_s / steps,
                    1e3 * cores * wall / steps,
                    generated / wall * time_scale,
                    1e6 * loop_s / generated,
                )
            )
    medians = [statistics.median(column) for column in zip(*per_round)]
    return Depth(" -> ".join(m.name for m in CHAIN[-depth:]), steps_total, *medians)


def table(rows: list[Depth], args: argparse.Namespace) -> str:
    head = (
        f"Emulated chain (mock stages), time scale {args.time_scale}, predraft {args.predraft}, {len(PROMPTS)} prompts x "
        f"{args.requests} in flight x {args.tokens} tokens, at most {args.max_batch} a forward, {args.rounds} rounds, "
        f"{'gRPC streams' if args.over_grpc else 'in-process links'} "
        "(medians over rounds). Per target step (a forward of the target, however many requests it carried):"
    )
    lines = [
        head,
        "",
        "| chain | target steps | messages | event loop CPU (ms) | process CPU (ms) | the machine's CPU (ms) | tok/s (emulated) "
        "| event loop CPU per committed token (us) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.chain} | {r.target_steps} | {r.messages:.1f} | {r.loop_ms:.2f} | {r.process_ms:.2f} | {r.machine_ms:.2f} "
        f"| {r.tokens_per_s:.2f} | {r.loop_us_per_token:.0f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time-scale", type=float, default=0.03, help="factor on every emulated latency")
    parser.add_argument("--predraft", type=int, default=0, help="branches each drafter pre-drafts (0: none)")
    parser.add_argument("--requests", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--depths", type=int, nargs="+", default=list(range(1, len(CHAIN) + 1)))
    parser.add_argument("--max-batch", type=int, default=1, help="requests one forward carries (the mocks' batched cost model)")
    parser.add_argument("--over-grpc", action="store_true", help="the stages linked by gRPC streams, not in process")
    args = parse_logged(parser, argv)
    for d in args.depths:
        if not 1 <= d <= len(CHAIN):
            parser.error(f"--depths: {d} is not within 1..{len(CHAIN)}")
    if args.max_batch < 1:
        parser.error(f"--max-batch: at least 1 request a forward, got {args.max_batch}")
    rows = [
        measure(d, args.time_scale, args.predraft, args.requests, args.rounds, args.tokens, args.max_batch, args.over_grpc)
        for d in args.depths
    ]
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
