"""tests/xdist_scheduling.py: under `make test`'s `-n 2 --dist loadfile`, the modules that start Ray share one
worker. A real xdist run in a subprocess, over two throwaway modules named like two of ours with a `ray` test:
loadfile alone gives each of two modules a worker of its own, so sharing one is the hook's doing. (xdist's own
`loadgroup` stopped grouping under pytest 9, and nothing failed: this test is what would say so.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

from tests.xdist_scheduling import RAY_MODULES  # noqa: E402 - xdist first

ROOT = Path(__file__).resolve().parents[1]


def test_the_ray_modules_are_the_ones_with_a_ray_test():
    """The modules are found by their marks: some that start Ray, none that does not."""
    assert {"test_cluster.py", "test_cli.py", "test_job_submit.py"} <= RAY_MODULES
    assert "test_exactness.py" not in RAY_MODULES and "test_xdist_scheduling.py" not in RAY_MODULES


def test_modules_with_a_ray_test_run_on_one_worker(tmp_path):
    """Two modules of RAY_MODULES, 4 tests each, under `-n 2 --dist loadfile`: all 8 on one worker."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.xdist_scheduling"]\n')
    for name in ("test_cluster.py", "test_drain.py"):  # two of RAY_MODULES
        (tmp_path / name).write_text("".join(f"def test_{i}():\n    pass\n\n\n" for i in range(4)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not our run's options
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-v", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    workers = {m.group(1) for m in re.finditer(r"\[(gw\d)\] .*PASSED", run.stdout)}
    assert len(re.findall(r"PASSED", run.stdout)) == 8 and len(workers) == 1, run.stdout
