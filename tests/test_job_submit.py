"""`ray job submit` of a pipeline config to a `ray start --head` cluster on loopback, end to end.

Starts a head node (its own Ray session for this module), submits `python -m pipespec.cluster.launch` with
the mock config, waits for the coordinator to answer, streams a generation through `Client`, then
stops the job and the cluster.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipespec import Client, LocalPipeline, load_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    from pipespec.cluster.pipeline import RAY_ENV

    env = {**os.environ, **RAY_ENV}
    ray = str(Path(sys.executable).with_name("ray"))
    gcs, dashboard = free_port(), free_port()
    # a short path: the head's sockets live under it, and an AF_UNIX path has at most 107 bytes (pytest's own
    # temporary directories, one per xdist worker, left the dashboard's sockets longer than that)
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:  # a head that failed half-way is stopped too
        subprocess.run(
            [ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
             f"--temp-dir={temp}", "--disable-usage-stats"],
            env=env, check=True, capture_output=True, timeout=180,
        )  # fmt: skip
        yield ray, f"http://127.0.0.1:{dashboard}", env
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_serves_a_pipeline(head, tmp_path):
    ray, dashboard, env = head
    port = free_port()
    job_id = f"pipespec-test-{port}"
    submit = [ray, "job", "submit", "--address", dashboard, "--submission-id", job_id, "--no-wait",
              "--working-dir", str(ROOT), "--", sys.executable, "-m", "pipespec.cluster.launch", "pipespec/configs/mock3.yaml",
              "--port", str(port)]  # fmt: skip
    subprocess.run(submit, env=env, check=True, capture_output=True, timeout=180, cwd=ROOT)
    try:
        client = Client(f"127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + 180
        while True:  # the job installs its working dir and places its actors: wait for the address to answer
            try:
                assert client.health() == "serving"
                break
            except Exception:  # noqa: BLE001 - not up yet (connection refused / unavailable)
                if time.monotonic() > deadline:
                    logs = subprocess.run(
                        [ray, "job", "logs", "--address", dashboard, job_id], env=env, capture_output=True, text=True
                    )
                    pytest.fail(f"the job never served: {logs.stdout[-3000:]}{logs.stderr[-2000:]}")
                time.sleep(0.5)  # polling a remote process we do not control, with a deadline
        got = client.generate(prompt_token_ids=[3, 4, 5], max_new_tokens=32)
        with LocalPipeline(load_config({"stages": [{"name": "t", "kind": "mock", "vocab_size": 128}]})) as ref:
            assert got.token_ids == ref.generate(prompt_token_ids=[3, 4, 5], max_new_tokens=32).token_ids
        assert [p.drafter for p in got.stats.pairs] == ["tiny", "mid"]
    finally:
        subprocess.run([ray, "job", "stop", "--address", dashboard, job_id], env=env, capture_output=True, timeout=120)
