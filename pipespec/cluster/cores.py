"""Which CPU cores each device actor's threads run on.

Ray reserves CPUs by count and does not say which cores they are, so two busy stage processes can
land on one core while another sits idle, and the kernel migrates compute threads between cores.
Each bundle of a pipeline's placement group that asks for whole CPUs gets its own slice of its
node's cores: bundles on one node take consecutive slices of that node's cores, in bundle order
(`slices`). A device actor pins every thread of its process to its slice (`pin_process`) before
torch starts its thread pool, so later threads inherit the mask. A bundle with a fractional CPU
share is not pinned, nor is a slice past the cores the process may use (the node has fewer cores
than Ray was told); the actor says which cores it got.

A baseline measured in the driver's process beside a pinned pipeline is pinned alike while it runs
(`pinned`): the demo's target alone on one thread, unpinned, ran at 0.69-0.71x its pinned rate
(100 against 141-145 tok/s, alternating in one process, 12 requests a side); its event-loop and compute
threads, free to run on different cores, likely wake each other across them.

This assumes the pipeline's bundles are the only pinned work on their nodes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreSlice:
    """`count` cores starting at the `offset`-th core the node's processes may use."""

    offset: int
    count: int


def slices(cpus: Sequence[float], nodes: Sequence[str]) -> list[CoreSlice | None]:
    """Per bundle (its CPUs, its node), its slice of the node's cores, or None for a fractional share."""
    used: dict[str, int] = {}
    out: list[CoreSlice | None] = []
    for n, node in zip(cpus, nodes):
        if n < 1 or n != int(n):
            out.append(None)
            continue
        offset = used.get(node, 0)
        used[node] = offset + int(n)
        out.append(CoreSlice(offset, int(n)))
    return out


def pin_process(cores: CoreSlice) -> tuple[int, ...] | None:
    """Pin every thread of this process to `cores`; -> the core ids, or None if it could not."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    chosen = allowed[cores.offset : cores.offset + cores.count]
    if len(chosen) < cores.count:
        log.warning("cannot pin to %d cores from the %d-th: this process may use only %s", cores.count, cores.offset, allowed)
        return None
    _pin_threads(chosen)
    return tuple(chosen)


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
    _pin_threads(chosen)
    try:
        yield tuple(chosen)
    finally:
        _pin_threads(allowed)


def _pin_threads(cores: Sequence[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass
