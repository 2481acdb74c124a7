"""`ray job submit` of a pipeline config to a `ray start --head` cluster on loopback, end to end.

Starts a head node (its own Ray session for this module: tests/fixtures/ray_head.py), submits `python -m
pipespec.cluster.launch` with the mock config, waits for the coordinator to answer, streams a generation through `Client`, then
stops the job and the cluster (by its process: never `ray stop`, which stops every Ray on the machine).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipespec import Client, LocalPipeline, load_config
from tests.fixtures.ports import free_port
from tests.fixtures.ray_head import RAY, ray_head

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def head():
    """A head of its own with its dashboard (job submission goes through it), stopped by its process at the end."""
    with ray_head(num_cpus=2, dashboard=True) as head:
        yield head


def test_ray_job_submit_serves_a_pipeline(head, tmp_path):
    ray, dashboard, env = RAY, head.dashboard, head.env
    port = free_port()
    job_id = f"pipespec-test-{port}"
    submit = [*ray, "job", "submit", "--address", dashboard, "--submission-id", job_id, "--no-wait",
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
                        [*ray, "job", "logs", "--address", dashboard, job_id], env=env, capture_output=True, text=True
                    )
                    pytest.fail(f"the job never served: {logs.stdout[-3000:]}{logs.stderr[-2000:]}")
                time.sleep(0.5)  # polling a remote process we do not control, with a deadline
        got = client.generate(prompt_token_ids=[3, 4, 5], max_new_tokens=32)
        with LocalPipeline(load_config({"stages": [{"name": "t", "kind": "mock", "vocab_size": 128}]})) as ref:
            assert got.token_ids == ref.generate(prompt_token_ids=[3, 4, 5], max_new_tokens=32).token_ids
        assert [p.drafter for p in got.stats.pairs] == ["tiny", "mid"]
    finally:
        subprocess.run([*ray, "job", "stop", "--address", dashboard, job_id], env=env, capture_output=True, timeout=120)
