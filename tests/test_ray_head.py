"""tests/fixtures/ray_head.py: Ray's command line found with or without a `ray` script beside the interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.ray_head import ray_cli


def test_the_script_beside_the_interpreter_when_there_is_one(tmp_path):
    python = tmp_path / "bin" / "python3"
    python.parent.mkdir()
    (python.parent / "ray").write_text("#!/bin/sh\n")
    assert ray_cli(str(python)) == [str(python.parent / "ray")]


def test_the_module_behind_it_when_there_is_none(tmp_path):
    python = str(tmp_path / "python3")  # the trimmed Ray of the GPU machine has no console scripts
    assert ray_cli(python) == [python, "-m", "ray.scripts.scripts"]
    # and that module is Ray's command line: it answers as the script does
    pytest.importorskip("ray")
    out = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and ", version " in out.stdout, out.stderr[-2000:]
    script = Path(sys.executable).with_name("ray")
    if script.is_file():
        version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120).stdout
        assert version.split(", version ")[1] == out.stdout.split(", version ")[1]
