"""Which CPU cores this process's threads may run on: a device's process (pipespec.cluster.cores gives each device
actor its slice) and a measurement taken beside it (`pinned`).

A baseline measured in the driver's process beside a pinned pipeline is pinned alike while it runs (`pinned`): the
demo's target alone on one thread, unpinned, ran at 0.69-0.71x its pinned rate (100 against 141-145 tok/s,
alternating in one process, 12 requests a side). On that 2-core virtual machine a wake-up across cores cost
70-220 us against 7-23 us on one core (experiments/results/host_work/README.md), and an unpinned process's
event-loop and compute threads wake each other across them. `pipespec plan` profiles pinned for the same reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


@contextmanager
def pinned(count: int) -> Iterator[tuple[int, ...] | None]:
    """Every thread of this process on the first `count` cores it may use while inside (threads started
    inside inherit them), all back on the cores the process may use after; yields the cores, or None
    where it cannot pin (no sched_setaffinity, or fewer cores than `count`)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if len(allowed) < count:
        yield None
        return
    chosen = allowed[:count]
    pin_threads(chosen)
    try:
        yield tuple(chosen)
    finally:
        pin_threads(allowed)


def pin_threads(cores: Sequence[int]) -> None:
    """Every thread of this process, now, on `cores` (threads it starts later inherit the mask of their parent)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass
