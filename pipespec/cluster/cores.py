"""Which CPU cores each device actor's threads run on.

Ray reserves CPUs by count and does not say which cores they are, so two busy stage processes can
land on one core while another sits idle, and the kernel migrates compute threads between cores.
Each bundle of a pipeline's placement group that asks for whole CPUs gets its own slice of its
node's cores: bundles on one node take consecutive slices of that node's cores, in bundle order
(`slices`). A device actor pins every thread of its process to its slice (`pin_process`) before
torch starts its thread pool, so later threads inherit the mask. A bundle with a fractional CPU
share is not pinned, nor is a slice past the cores the process may use (the node has fewer cores
than Ray was told); the actor says which cores it got.

A baseline measured beside a pinned pipeline is pinned alike (pipespec.engine.affinity.pinned).

This assumes the pipeline's bundles are the only pinned work on their nodes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from pipespec.engine.affinity import pin_threads

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
    pin_threads(chosen)
    return tuple(chosen)
