"""Tests for pipespec/cluster/cores.py: each bundle of whole CPUs gets its own cores on its node."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipespec.cluster.cores import CoreSlice, slices


def test_bundles_take_consecutive_cores_of_their_node():
    got = slices([1, 2, 0.5, 1, 1], ["a", "a", "a", "b", "a"])
    assert got == [CoreSlice(0, 1), CoreSlice(1, 2), None, CoreSlice(0, 1), CoreSlice(3, 1)]


def test_a_fractional_share_is_not_pinned():
    assert slices([1.5, 0.2], ["a", "a"]) == [None, None]


PROBE = """
import os, threading, torch
from pipespec.cluster.cores import CoreSlice, pin_process
early = threading.Thread(target=threading.Event().wait, daemon=True)
early.start()  # a thread from before the pinning is pinned too
print(pin_process(CoreSlice({offset}, 1)))
torch.set_num_threads(2)
torch.ones(512, 512) @ torch.ones(512, 512)  # starts torch's pool after the pinning
print(sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores and Linux")
def test_pinning_covers_every_thread_of_the_process():
    allowed = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PROBE.format(offset=1)], capture_output=True, text=True, check=True).stdout.split(
        "\n"
    )
    assert out[0] == f"({allowed[1]},)"
    assert out[1] == f"[({allowed[1]},)]"


def test_a_slice_past_the_cores_is_not_pinned():
    out = subprocess.run([sys.executable, "-c", PROBE.format(offset=4096)], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "None"
