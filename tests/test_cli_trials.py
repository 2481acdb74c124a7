"""`pipespec plan --trials` (pipespec/cli/trials.py): the plan's contenders run in place on a local Ray
(mock stages), each round beside the target alone in this process, and the greatest speedup measured
recommended."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from pipespec.cli import main
from pipespec.cli.trials import ROUNDS
from pipespec.config import load_config
from pipespec.planning.plan import TRIAL_TIE

pytest.importorskip("ray")  # the device machine runs without Ray
pytestmark = pytest.mark.ray


def test_plan_tries_its_contenders_in_place_and_recommends_the_greatest_speedup_measured(tmp_path, capsys):
    """Mock stages on a local Ray, a core each: what each chain delivers is measured, not assumed; the
    target alone cannot beat its own 20 ms forward."""
    raw = {
        "name": "trial-cli",
        "stages": [
            {"name": "tiny", "kind": "mock", "agreement": 0.9, "latency_ms": 2, "vocab_size": 64},
            {"name": "mid", "kind": "mock", "agreement": 0.9, "latency_ms": 6, "vocab_size": 64},
            {"name": "target", "kind": "mock", "latency_ms": 20, "vocab_size": 64},
        ],
    }
    path, out_json, out_yaml = tmp_path / "mock.yaml", tmp_path / "plan.json", tmp_path / "rec.yaml"
    path.write_text(yaml.safe_dump(raw))
    argv = ["plan", str(path), "--devices", "2", "--prompt", "one", "--max-new-tokens", "24", "--trials", "2"]
    assert main([*argv, "--json", str(out_json), "--write-config", str(out_yaml)]) == 0
    out = capsys.readouterr().out
    assert f"tried in place (a local Ray, {ROUNDS} rounds" in out and "measured in place" in out
    figures = json.loads(out_json.read_text())
    trials = figures["trials"]
    assert len(trials) == 4 and sum(t["candidate"]["stages"] == ["target"] for t in trials) == 1
    trees = [t["candidate"] for t in trials if t["candidate"]["tree"] is not None]  # the first chain again, with trees
    assert len(trees) == 1 and trees[0]["tree"]["budget"] == 7 and trees[0]["tree"]["temperature"] > 0
    assert all(len(t["rounds"]) == len(t["alone"]) == ROUNDS and all(r > 0 for r in t["rounds"] + t["alone"]) for t in trials)
    in_ray = next(t for t in trials if t["candidate"]["stages"] == ["target"])
    assert max(in_ray["rounds"] + in_ray["alone"]) < 1000 / 20  # a token per 20 ms forward at best: measured, not predicted
    chosen = next(t for t in trials if t["candidate"] == figures["recommended"])
    speedup = {id(t): statistics.median(p / a for p, a in zip(t["rounds"], t["alone"])) for t in trials}
    best = max(speedup.values())
    simplest = min(
        (t for t in trials if speedup[id(t)] >= (1 - TRIAL_TIE) * best),
        key=lambda t: (len(t["candidate"]["placement"]), len(t["candidate"]["stages"]), -speedup[id(t)]),
    )
    assert simplest["candidate"] == figures["recommended"]  # the greatest speedup, or a simpler one within the noise
    assert statistics.median(chosen["rounds"]) == figures["predicted_tokens_per_s"]
    assert speedup[id(chosen)] == figures["predicted_speedup"]
    written = load_config(out_yaml)
    assert [s.name for s in written.stages] == figures["recommended"]["stages"]
    header = out_yaml.read_text().splitlines()[0]
    assert header.endswith(
        f"{figures['predicted_tokens_per_s']:.1f} tok/s, {figures['predicted_speedup']:.2f}x the target alone, measured in place"
    )
