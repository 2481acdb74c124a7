"""The suite's own scheduling (tests/conftest.py): under `make test`'s `-n 2 --dist loadfile`, the modules that
start Ray share one worker. A real xdist run in a subprocess, over two throwaway modules named like two of ours
with a `ray` test: loadfile alone gives each of two modules a worker of its own, so sharing one is the hook's doing.
(xdist's own `loadgroup` stopped grouping under pytest 9, and nothing failed: this test is what would say so.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import _RAY_MODULES

ROOT = Path(__file__).resolve().parents[1]


def test_the_ray_modules_are_the_ones_with_a_ray_test():
    assert {"test_cluster.py", "test_cli.py", "test_job_submit.py"} <= _RAY_MODULES
    assert "test_exactness.py" not in _RAY_MODULES and "test_conftest.py" not in _RAY_MODULES


def test_modules_with_a_ray_test_run_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n")
    for name in ("test_cluster.py", "test_drain.py"):  # two of _RAY_MODULES
        (tmp_path / name).write_text("".join(f"def test_{i}():\n    pass\n\n\n" for i in range(4)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")} | {"PYTHONPATH": str(ROOT)}  # not a worker's
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-v", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    workers = {m.group(1) for m in re.finditer(r"\[(gw\d)\] .*PASSED", run.stdout)}
    assert len(re.findall(r"PASSED", run.stdout)) == 8 and len(workers) == 1, run.stdout
