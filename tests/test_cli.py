"""The command line end to end: `pipespec serve` a config on a local Ray, `pipespec generate` from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.fixtures import DEMO_MODELS

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PIPESPEC = str(Path(sys.executable).with_name("pipespec"))


def ray_env() -> dict[str, str]:
    """This environment, with Ray kept on loopback and no cluster to join: each command starts its own."""
    from pipespec.cluster.pipeline import RAY_ENV

    return {**os.environ, **RAY_ENV, "RAY_ADDRESS": ""}


@contextmanager
def serving(config: Path) -> Iterator[str]:
    """`pipespec serve CONFIG` in a process of its own; yields the address it prints once serving, then
    stops it with SIGTERM, on which it must exit 0."""
    server = subprocess.Popen(
        [PIPESPEC, "serve", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_env()
    )
    try:
        address = None
        for line in server.stdout:  # blocks until serve prints its address (or exits)
            if "serving" in line:
                address = line.rsplit(" at ", 1)[1].strip()
                break
        assert address, "pipespec serve exited without serving"
        yield address
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=120)
    assert server.returncode == 0


def test_serve_then_generate(family, tmp_path):
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
    env = ray_env()
    with serving(path) as address:
        out = subprocess.run(
            [PIPESPEC, "generate", "--address", address, "--prompt", "the red circle", "--max-new-tokens", "12"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "[length; 12 tokens; mean acceptance length tiny->target" in out.stderr
        bad = subprocess.run(
            [PIPESPEC, "generate", "--address", address, "--prompt", "x", "--temperature", "-2"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert bad.returncode == 2 and bad.stderr == "pipespec generate: temperature must be >= 0, got -2.0\n"  # nothing sent
        over = subprocess.run(
            [PIPESPEC, "generate", "--address", address, "--prompt", "x", "--max-new-tokens", "9000"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert (
            over.returncode == 1
            and over.stderr == "pipespec generate: max_new_tokens 9000 is over limits.max_new_tokens (8192)\n"
        )


def test_serve_a_vlm_then_generate_with_an_image(tmp_path):
    """A VLM target in Ray actors; `pipespec generate --image` sends the file; equals the target alone."""
    import numpy as np
    from PIL import Image

    from pipespec import LocalPipeline, load_config
    from pipespec.cli import _printable
    from tests.fixtures.vlm_zoo import build_zoo_family

    paths = build_zoo_family("llava", tmp_path / "zoo")
    picture = tmp_path / "picture.png"
    Image.fromarray((np.random.default_rng(3).random((48, 40, 3)) * 255).astype(np.uint8)).save(picture)
    stage = lambda n, kind: {"name": n, "kind": kind, "model": str(paths[n]), "dtype": "float32", "resources": {"num_cpus": 0.5}}  # noqa: E731
    config = {"name": "vlm", "stages": [stage("tiny", "causal_lm"), stage("target", "vlm")], "server": {"port": 0}}
    with LocalPipeline(load_config({"stages": [stage("target", "vlm")]})) as alone:
        expected = alone.generate("the red circle", image=str(picture), max_new_tokens=12).text
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    with serving(path) as address:
        run = lambda *extra: subprocess.run(  # noqa: E731
            [PIPESPEC, "generate", "--address", address, "--prompt", "the red circle", "--max-new-tokens", "12", *extra],
            capture_output=True, text=True, timeout=120, env=ray_env(),
        )  # fmt: skip
        out = run("--image", str(picture))
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == _printable(expected).strip()
        missing = run("--image", str(tmp_path / "nope.png"))
        assert missing.returncode == 2 and f"image file '{tmp_path / 'nope.png'}' does not exist" in missing.stderr


def test_demo_runs_the_shipped_models_exactly(tmp_path):
    """`pipespec demo`: local Ray, tiny -> dream -> VLM target from models/demo, figures as JSON."""
    import json

    out = tmp_path / "demo.json"
    run = subprocess.run(
        [PIPESPEC, "demo", "--max-new-tokens", "24", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ray_env(),
        cwd=DEMO_MODELS.parents[1],  # the checkout's root, where `make demo` runs: --models defaults to models/demo there
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    assert figures["exact"] is True
    assert [(p["drafter"], p["verifier"]) for p in figures["pairs"]] == [("tiny", "dream"), ("dream", "target")]
    assert figures["tokens_per_second"] > 0 and figures["speedup_vs_target"] > 0
    assert "identical to the target alone: yes" in run.stdout
    assert len(figures["rounds"]) == 3 and "medians of 3 alternating runs" in run.stdout  # --runs defaults to 3
    assert [d["stages"] for d in figures["placement"]] == [["tiny"], ["dream"], ["target"]]
    cores = sum(d["resources"]["num_cpus"] for d in figures["placement"])
    assert figures["target_alone_threads"] in (1, max(1, round(cores)))  # whichever ran it faster
    assert "placement:\n  device 1: tiny" in run.stdout and "target alone: in this process" in run.stdout
    truth = json.loads((DEMO_MODELS / "example.json").read_text())["truth"]
    assert f"the picture shows: {truth}" in run.stdout  # under the answer, so a reader can judge it


def test_an_unknown_strategy_is_refused_before_anything_starts(capsys):
    from pipespec.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["serve", "mock3", "--strategy", "bogus"])
    assert refused.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_serve_names_resources_it_can_never_place_and_exits_2(tmp_path):
    stage = {"name": "t", "kind": "mock", "vocab_size": 16, "resources": {"num_cpus": 1000}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "huge", "stages": [stage], "server": {"port": 0}}))
    out = subprocess.run([PIPESPEC, "serve", str(path)], capture_output=True, text=True, timeout=300, env=ray_env())
    assert out.returncode == 2, out.stderr
    assert "{'CPU': 1000.0}] can never be placed (pack): no node has the resources" in out.stderr
    assert "Traceback" not in out.stderr
