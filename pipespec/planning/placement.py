"""Placements: which device each stage of a chain runs on, and what a device is.

A device is what one forward runs on (design section 5b): here a set of CPU cores, `Devices` says how
many a plan may use and how many cores each has. Stages placed on the same device share it (one actor,
one compute thread, one forward at a time); a config says so with `device_group`. The planner
(pipespec.planning.plan) predicts every chain on every placement that fits the devices it is given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

Placement = tuple[int, ...]  # per stage of a chain, upstream first, the index of its device


@dataclass(frozen=True)
class Devices:
    """`count` identical devices of `cpus` cores each (fractional when there are more devices than cores)."""

    count: int
    cpus: float

    @property
    def threads(self) -> int:
        """Torch threads of a stage on one device: its cores, at least one."""
        return max(1, int(self.cpus))

    @classmethod
    def of_this_machine(cls, count: int | None = None) -> Devices:
        """This machine's cores split into `count` devices (default: a device per core); ValueError if count < 1."""
        cores = os.cpu_count() or 1
        count = cores if count is None else count
        if count < 1:
            raise ValueError(f"a plan needs at least one device, got {count}")
        return cls(count, cores // count if cores >= count else int(cores / count * 100) / 100)  # count * cpus <= cores


def placements(stages: int, devices: int) -> list[Placement]:
    """Every way to place `stages` stages on at most `devices` identical devices, each once: devices are
    numbered in the order of their first stage (stage 0 on device 0, each next stage on a device already
    used or on the next new one). A device per stage comes last."""
    out: list[Placement] = [()]
    for _ in range(stages):
        out = [p + (d,) for p in out for d in range(min(devices, max(p, default=-1) + 2))]
    return out


def on_devices(names: Sequence[str], placement: Placement) -> tuple[tuple[str, ...], ...]:
    """The stage names on each device, devices in order."""
    return tuple(tuple(n for n, d in zip(names, placement) if d == device) for device in range(max(placement) + 1))


def label(groups: Sequence[Sequence[str]]) -> str:
    """`tiny+dream | target`: stages on one device joined by +, devices by |."""
    return " | ".join("+".join(group) for group in groups)
