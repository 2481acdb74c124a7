"""The command line end to end: `pipespec serve` a config on a local Ray, `pipespec generate` from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_serve_then_generate(family, tmp_path):
    from cluster.pipeline import RAY_ENV

    config = {
        "name": "cli",
        "stages": [
            {"name": n, "kind": "causal_lm", "model": family[n], "dtype": "float32", "resources": {"num_cpus": 0.5}}
            for n in ("tiny", "target")
        ],
        "server": {"port": 0},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    pipespec = str(Path(sys.executable).with_name("pipespec"))
    env = {**os.environ, **RAY_ENV, "RAY_ADDRESS": ""}
    server = subprocess.Popen(
        [pipespec, "serve", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        address = None
        for line in server.stdout:  # blocks until serve prints its address (or exits)
            if "serving" in line:
                address = line.rsplit(" at ", 1)[1].strip()
                break
        assert address, "pipespec serve exited without serving"
        out = subprocess.run(
            [pipespec, "generate", "--address", address, "--prompt", "the red circle", "--max-new-tokens", "12"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "[length; 12 tokens; mean acceptance length tiny->target" in out.stderr
        bad = subprocess.run(
            [pipespec, "generate", "--address", address, "--prompt", "x", "--temperature", "-2"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert bad.returncode == 1 and "temperature must be >= 0, got -2.0" in bad.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=120)
    assert server.returncode == 0
