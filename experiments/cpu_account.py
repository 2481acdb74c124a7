"""CPU seconds per process group over a window: where the machine's cores went while a method ran.

Groups: the named processes (a pipeline's device actors and its coordinator, by pid), this process
(the benchmark's driver and client, or an in-process method), the rest of Ray (raylet, GCS, idle
workers) and everything else on the machine. Read from /proc (Linux) at the start and the end of
the window; a process that starts within it counts whole. Elsewhere every figure is empty.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot() -> dict[int, float]:
    """CPU seconds (user + system) of every process now."""
    out = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    return out


def _group(pid: int, named: Mapping[int, str]) -> str:
    if pid in named:
        return named[pid]
    if pid == os.getpid():
        return "this process (driver, client)"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    return "ray (raylet, gcs, workers)" if "ray" in cmd else "other"


def used(before: dict[int, float], after: dict[int, float], named: Mapping[int, str]) -> dict[str, float]:
    """CPU seconds per group between two snapshots."""
    groups: dict[str, float] = {}
    for pid, seconds in after.items():
        delta = seconds - before.get(pid, 0.0)
        if delta > 0:
            name = _group(pid, named)
            groups[name] = groups.get(name, 0.0) + delta
    return groups
