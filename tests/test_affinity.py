"""Tests for pipespec/engine/affinity.py: a measurement pinned to as many cores as its threads while it runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PINNED = """
import os, threading
from pipespec.engine.affinity import pinned
def masks():
    return sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}})
early = threading.Thread(target=threading.Event().wait, daemon=True)
early.start()  # a thread from before is pinned too, and let go after
with pinned({count}) as cores:
    inside = threading.Thread(target=threading.Event().wait, daemon=True)
    inside.start()  # a thread started inside inherits the cores
    print(cores, masks())
print(masks())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores and Linux")
def test_a_baseline_is_pinned_while_inside_and_let_go_after():
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    run = subprocess.run([sys.executable, "-c", PINNED.format(count=1)], capture_output=True, text=True, check=True)
    inside, after = run.stdout.splitlines()
    assert inside == f"({allowed[0]},) [({allowed[0]},)]"
    assert after == f"[{allowed}]"
    run = subprocess.run([sys.executable, "-c", PINNED.format(count=4096)], capture_output=True, text=True, check=True)
    assert run.stdout.splitlines() == [f"None [{allowed}]", f"[{allowed}]"]  # more cores than allowed: left alone
