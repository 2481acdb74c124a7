"""What the runtime costs the target alone, layer by layer: a decode loop, the runtime in one process, a Ray deployment.

    python -m experiments.runtime_overhead [CONFIG] [--prompts FILE] [--limit 12] [--rounds 5] [--max-new-tokens 96]

The config's target alone (greedy, one torch thread), the same prompts, timed as a client sees whole requests;
the methods alternate round by round, medians over rounds, each beside the first:

- `decode loop`: `generate_sync` on the loaded target, in this thread, pinned to the first core (the bench's
  `target, 1 thread`); its requests prepared beforehand (the front door's image processing is not timed);
- `runtime, one core`: a `LocalPipeline` of the same loaded target (its event loop, the device's compute thread,
  the coordinator and this thread as its client), every thread pinned to the first core;
- `runtime, loop on another core`: the same with only the compute thread on the first core (needs 2 cores);
- `Ray actor`: the target alone deployed (`start_pipeline` on a local Ray: its device actor pinned to a core,
  the coordinator's actor, gRPC streams), streamed through `pipespec.Client` from this process.

Then, what a wake-up across cores costs here (`round_trip_us`: a byte's round trip between two processes, on
one core or two, after the receiver idled): each step of the runtime wakes a thread or a process, and where that
crosses cores the wake-up is the price. Unix only (thread affinities, fork). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from experiments.prompt_sets import load_prompts
from pipespec import LocalPipeline, load_config
from pipespec.cli.timed_requests import timed, tokens_per_s
from pipespec.commands.logs import parse_logged
from pipespec.config import PipelineConfig, sub_pipeline
from pipespec.engine.affinity import pin_threads, pinned
from pipespec.engine.synchronous import generate_sync


@contextmanager
def placed(compute_core: int, other_core: int) -> Iterator[None]:
    """While inside, this process's device compute threads (named device-*, those running when it is entered: a
    device's starts with its first forward, so warm up first) on `compute_core` and every other thread on
    `other_core`; after, every thread back on the cores the process may use."""
    allowed = sorted(os.sched_getaffinity(0))
    pin_threads([other_core])
    for thread in threading.enumerate():
        if thread.name.startswith("device-") and thread.native_id is not None:
            os.sched_setaffinity(thread.native_id, {compute_core})
    try:
        yield
    finally:
        pin_threads(allowed)


def streamed(client: Any, requests: Sequence[dict]) -> float:
    """Tokens a second over whole requests, streamed through `client` (a LocalPipeline or a pipespec.Client) and
    timed as `pipespec demo` and the planner's trials time them (pipespec.cli.timed_requests)."""
    return tokens_per_s([timed(client.stream, request) for request in requests])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default="pipespec/configs/demo_two_cores.yaml")
    parser.add_argument("--prompts", default="experiments/prompts/world_held_out.jsonl")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parse_logged(parser, argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        parser.error(f"needs 2 cores; this process may use {cores}")
    first, second = cores[:2]

    config = load_config(args.config)
    alone = sub_pipeline(config, [config.target.name])
    requests = [
        {"prompt": p.text, "max_new_tokens": args.max_new_tokens, **({"image": str(p.image)} if p.image else {})}
        for p in load_prompts(args.prompts)[: args.limit]
    ]
    torch.set_num_threads(1)
    with LocalPipeline(alone, torch_threads=1) as local:
        rates = measure(local, alone, requests, args.rounds, (first, second))

    base = statistics.median(rates["decode loop"])
    print(f"{config.target.name} alone, {len(requests)} prompts, up to {args.max_new_tokens} tokens, one torch thread, ", end="")
    print(f"{args.rounds} rounds\n")
    print("| method | tok/s (median) | rounds | x decode loop |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {', '.join(f'{v:.0f}' for v in values)} | {median / base:.2f}x |")
    print("\nA wake-up's round trip between two processes (a byte each way through pipes), after the receiver idled:\n")
    print("| receiver idle | same core | another core |")
    print("|---|---|---|")
    for idle_ms in (0.1, 1.0, 5.0, 20.0):
        print(f"| {idle_ms:g} ms | {round_trip_us(first, first, idle_ms)} | {round_trip_us(first, second, idle_ms)} |")


def measure(
    local: LocalPipeline, alone: PipelineConfig, requests: Sequence[dict], rounds: int, cores: tuple[int, int]
) -> dict[str, list[float]]:
    """Each method's tokens a second in each round (the module docstring's methods, in its order, alternating);
    `local`: the target alone in this process, started; `alone`: its config, deployed on a local Ray here."""
    from pipespec import Client
    from pipespec.cluster.pipeline import local_ray, start_pipeline

    first, second = cores
    target = local.stages[-1]
    specs = [local.request(**kwargs)[0] for kwargs in requests]

    def decode_loop() -> float:
        with pinned(1):
            start = time.perf_counter()
            tokens = sum(len(generate_sync(target, spec, None, 0).token_ids) for spec in specs)
            return tokens / (time.perf_counter() - start)

    def runtime(compute_core: int, other_core: int) -> Callable[[], float]:
        def run() -> float:
            with placed(compute_core, other_core):
                return streamed(local, requests)

        return run

    with local_ray():
        running = start_pipeline(alone, port=0, pin_cores=True)
        try:
            client = Client(running.address)
            methods: dict[str, Callable[[], float]] = {
                "decode loop": decode_loop,
                "runtime, one core": runtime(first, first),
                "runtime, loop on another core": runtime(first, second),
                "Ray actor": lambda: streamed(client, requests),
            }
            for method in methods.values():  # warm up (a device's compute thread starts with its first forward)
                method()
            rates: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(rounds):
                for name, method in methods.items():
                    rates[name].append(method())
            return rates
        finally:
            running.stop()


def round_trip_us(core: int, peer_core: int, idle_ms: float, trips: int = 300) -> str:
    """Median and 90th percentile microseconds of a ping (one byte through a pipe) to a process pinned to `peer_core`
    and its pong back, sent from `core` after busy-waiting `idle_ms` (the peer blocked in read meanwhile)."""
    ping_r, ping_w = os.pipe()
    pong_r, pong_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the peer: echo until told to stop, or its parent is gone (end of file); never returns
        try:
            os.close(ping_w)
            os.close(pong_r)
            os.sched_setaffinity(0, {peer_core})
            while (byte := os.read(ping_r, 1)) not in (b"q", b""):
                os.write(pong_w, byte)
        finally:
            os._exit(0)
    os.close(ping_r)
    os.close(pong_w)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    times = []
    try:
        for _ in range(trips):
            until = time.perf_counter() + idle_ms / 1e3
            while time.perf_counter() < until:
                pass
            start = time.perf_counter()
            os.write(ping_w, b"x")
            os.read(pong_r, 1)
            times.append((time.perf_counter() - start) * 1e6)
    finally:
        os.write(ping_w, b"q")
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, allowed)
        os.close(ping_w)
        os.close(pong_r)
    times.sort()
    return f"{statistics.median(times):.0f} us (p90 {times[int(0.9 * len(times))]:.0f})"


if __name__ == "__main__":
    main()
