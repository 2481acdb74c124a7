"""The soak: many concurrent streams for minutes on the mock pipeline, clients leaving at random,
a drafter killed (SIGKILL) every minute and restored by the supervisor. Not part of the test run.

    python -m experiments.soak [--minutes 10] [--streams 64] [--restart-every 60] [--drop 0.2]

Every stream that is not dropped on purpose must finish and equal the target alone (mock stages
are deterministic); a stream that takes longer than `--hang-s` counts as hung. The resident memory
of each actor (by role: a restarted drafter is a new process) and of the driver is sampled every
`--sample-s`; the first and last samples of each role are compared. Writes a JSON summary to
experiments/results/soak/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from pipespec import Client, GenerationError, LocalPipeline, load_config
from pipespec.commands.logs import add_log_level, setup_logging
from pipespec.config import sub_pipeline

log = logging.getLogger("soak")
CONFIG = "pipespec/configs/mock3.yaml"
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pid: int) -> float | None:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20
    except OSError:
        return None


def request(rng: random.Random) -> dict:
    return dict(
        prompt_token_ids=[rng.randrange(1, 128) for _ in range(rng.randrange(2, 8))],
        max_new_tokens=rng.randrange(8, 64),
        temperature=rng.choice([0.0, 0.8]),
        seed=rng.randrange(1000),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--restart-every", type=float, default=60.0, help="seconds between drafter kills")
    parser.add_argument("--drop", type=float, default=0.2, help="chance a client leaves mid-stream")
    parser.add_argument("--hang-s", type=float, default=120.0)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--out", default="experiments/results/soak")
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, fmt="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from pipespec.cluster.pipeline import local_ray, start_pipeline

    config = load_config(CONFIG)
    kills = int(args.minutes * 60 / args.restart_every) + 1  # each drafter restarts about half of these
    config = replace(config, faults=replace(config.faults, max_restarts=kills))
    target = config.target  # the reference: the target alone, without its emulated latency (same tokens)
    alone_config = replace(
        sub_pipeline(config, [target.name]), stages=(replace(target, options=replace(target.options, latency_ms=0.0)),)
    )
    counts: Counter = Counter()
    problems: list[str] = []
    lock = threading.Lock()
    with LocalPipeline(alone_config) as alone, local_ray():
        running = start_pipeline(config, port=0)
        failures: list[str] = []
        running.supervise(failures.append)
        client = Client(running.address, timeout=args.hang_s)
        start = time.monotonic()
        end = start + args.minutes * 60

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end:
                req = request(rng)
                leave_after = rng.randrange(1, 6) if rng.random() < args.drop else None
                ids, last, error = [], None, None
                try:
                    for n, delta in enumerate(client.stream(**req)):
                        ids.extend(delta.token_ids)
                        last = delta
                        if leave_after is not None and n + 1 >= leave_after:
                            break
                except GenerationError as e:
                    error = str(e)
                with lock:
                    if error is not None:
                        counts["hung" if "DEADLINE_EXCEEDED" in error else "errors"] += 1
                        problems.append(error)
                    elif last.finish_reason is None:
                        counts["dropped"] += 1
                    elif ids != alone.generate(**req).token_ids:
                        counts["inexact"] += 1
                        problems.append(f"inexact: {req}")
                    else:
                        counts["exact"] += 1

        threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(args.streams)]
        for t in threads:
            t.start()
        memory: dict[str, list[float]] = {}
        kills = 0
        next_kill, next_sample = time.monotonic() + args.restart_every, time.monotonic()
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                roles = {"driver": os.getpid()} | {
                    n: p for n, p in running.pids().items() if p is not None
                }  # a restarting one: skipped
                for role, pid in roles.items():
                    if (mb := rss_mb(pid)) is not None:
                        memory.setdefault(role, []).append(round(mb, 1))
                with lock:
                    log.warning(
                        "t=%4.0f s %s memory %s",
                        now - start,
                        dict(counts),
                        {r: m[-1] for r, m in memory.items()},
                    )
                next_sample = now + args.sample_s
            if now >= next_kill:
                drafter = ["tiny", "mid"][kills % 2]
                pid = running.pids()[f"device {drafter}"]
                if pid is not None:  # (still being restored: the next one's turn)
                    os.kill(pid, signal.SIGKILL)
                    log.warning("killed %s (pid %d)", drafter, pid)
                kills += pid is not None
                next_kill = now + args.restart_every
            time.sleep(0.5)
        for t in threads:
            t.join(timeout=args.hang_s + 10)
        stuck = sum(t.is_alive() for t in threads)
        restores = running.supervisor.restores
        running.stop()
    summary = {
        "minutes": args.minutes,
        "streams": args.streams,
        "counts": dict(counts),
        "stuck_workers": stuck,
        "drafter_kills": kills,
        "restores": restores,
        "supervisor_failures": failures,
        "problems": problems[:20],
        "memory_mb_first_last": {role: (m[0], m[-1], max(m)) for role, m in memory.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    ok = not problems and not stuck and not failures and restores == kills
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
