"""The plan's trials (pipespec/planning/trial.py): which candidates are tried, which one is recommended from
what was measured, and `pipespec plan --trials` running them in place on a local Ray (mock stages)."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from pipespec.cli import main
from pipespec.config import load_config
from pipespec.planning.placement import Devices
from pipespec.planning.plan import explain, format_plan, recommend
from pipespec.planning.profiling import PairProfile, Profile, StageProfile
from pipespec.planning.trial import ROUNDS, TRIAL_TIE, Trial, contenders, tried


def synthetic_plan(devices: int = 2):
    """A plan for a 7 ms drafter (alpha 0.6) and a 40 ms target, profiled elsewhere, on `devices` of one core."""
    stages = (StageProfile("tiny", "mock", 0.002, 0.002, 8), StageProfile("d", "mock", 0.007, 0.007, 8))
    stages += (StageProfile("target", "mock", 0.040, 0.040, 8),)
    pairs = (PairProfile("tiny", "d", 0.8), PairProfile("tiny", "target", 0.5), PairProfile("d", "target", 0.6))
    raw = {"name": "trial-test", "stages": [{"name": s.name, "kind": "mock", "vocab_size": 64} for s in stages]}
    return recommend(Profile("synthetic", stages, pairs, ("p",), None, 64, 4), raw, Devices(devices, 1))


def on(plan, stages: tuple[str, ...], devices: int):
    """The plan's candidate for the chain `stages` on `devices` devices."""
    return next(c for c in plan.chains if c.stages == stages and c.devices == devices)


def test_the_recommended_candidate_the_best_of_the_next_chains_and_the_target_alone_are_tried():
    plan = synthetic_plan()
    tried_ones = contenders(plan, 2)
    assert tried_ones[0] == plan.recommended and tried_ones[-1].stages == ("target",)
    assert len(tried_ones) == 3 and len({c.stages for c in tried_ones}) == 3
    second = tried_ones[1]
    assert second == max(
        (c for c in plan.chains if c.stages not in (plan.recommended.stages, ("target",))), key=lambda c: c.tokens_per_s
    )
    every = contenders(plan, 10)  # no more than the chains there are, each once
    assert len(every) == len({c.stages for c in plan.chains})


def test_the_greatest_speedup_measured_is_recommended_and_its_measurement_is_the_prediction():
    """d+target ran while the machine was fast (more tok/s, but less than the target alone beside it)."""
    plan = synthetic_plan()
    apart, shared, alone = on(plan, ("d", "target"), 2), on(plan, ("d", "target"), 1), on(plan, ("target",), 1)
    trials = (
        Trial(shared, (80.0, 80.0, 80.0), (100.0, 100.0, 100.0)),
        Trial(alone, (30.0, 31.0, 29.0), (40.0, 40.0, 40.0)),
        Trial(apart, (60.0, 62.0, 70.0), (40.0, 40.0, 35.0)),
    )
    result = tried(plan, trials)
    assert result.recommended == apart and result.predicted == 62.0 and result.predicted_speedup == 1.55
    assert [t.candidate for t in result.trials] == [apart, shared, alone]  # the greatest speedup first
    assert result.predicted != apart.tokens_per_s  # the model's figure stays beside it, not as the prediction
    lines = explain(result).splitlines()
    assert lines[0].endswith(
        "62.0 tok/s measured in place, 1.55x the target alone in this process (40.0 tok/s, side by side); "
        f"the model predicted {apart.tokens_per_s:.1f} ({apart.speedup:.2f}x)"
    )
    assert lines[1] == "why: the greatest speedup of 3 tried in place; next: d -> target on d+target, 80.0 tok/s (0.80x)"
    table = format_plan(result)
    assert "tried in place (a local Ray, 3 rounds" in table and "60.0 (40.0) / 62.0 (40.0) / 70.0 (35.0)" in table
    assert f"{apart.tokens_per_s:>10.1f}{62.0:>10.1f}{1.55:>8.2f}x" in table  # the model's prediction beside the measurement


def test_within_the_noise_of_the_greatest_speedup_fewer_devices_win():
    plan = synthetic_plan()
    apart, shared, alone = on(plan, ("d", "target"), 2), on(plan, ("d", "target"), 1), on(plan, ("target",), 1)
    near = 60.0 * (1 - TRIAL_TIE) + 0.5
    result = tried(plan, (Trial(apart, (60.0,), (30.0,)), Trial(shared, (near,), (30.0,)), Trial(alone, (25.0,), (30.0,))))
    assert result.recommended == shared and result.predicted == near
    why = explain(result).splitlines()[1]
    assert why.startswith(
        f"why: within {TRIAL_TIE:.0%} of the greatest speedup tried (d -> target on d | target"
    ) and why.endswith("on fewer devices")
    result = tried(plan, (Trial(apart, (60.0,), (30.0,)), Trial(shared, (near - 1.0,), (30.0,)), Trial(alone, (25.0,), (30.0,))))
    assert result.recommended == apart


def test_an_untried_plan_predicts_with_the_model():
    plan = synthetic_plan()
    assert plan.trials == () and plan.predicted == plan.recommended.tokens_per_s
    assert plan.predicted_speedup == plan.recommended.speedup
    assert "tried in place" not in format_plan(plan) and "tok/s predicted" in explain(plan)


@pytest.mark.ray
def test_cli_tries_the_best_chains_in_place_and_recommends_the_fastest_measured(tmp_path, capsys):
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
    assert len(trials) == 3 and sum(t["candidate"]["stages"] == ["target"] for t in trials) == 1
    assert all(len(t["rounds"]) == len(t["alone"]) == ROUNDS and all(r > 0 for r in t["rounds"] + t["alone"]) for t in trials)
    in_ray = next(t for t in trials if t["candidate"]["stages"] == ["target"])
    assert max(in_ray["rounds"] + in_ray["alone"]) < 1000 / 20  # a token per 20 ms forward at best: measured, not predicted
    chosen = next(t for t in trials if t["candidate"] == figures["recommended"])
    speedups = [statistics.median(p / a for p, a in zip(t["rounds"], t["alone"])) for t in trials]
    assert statistics.median(chosen["rounds"]) == figures["predicted_tokens_per_s"]
    assert figures["predicted_speedup"] == max(speedups) or figures["predicted_speedup"] >= (1 - TRIAL_TIE) * max(speedups)
    written = load_config(out_yaml)
    assert [s.name for s in written.stages] == figures["recommended"]["stages"]
    header = out_yaml.read_text().splitlines()[0]
    assert header.endswith(
        f"{figures['predicted_tokens_per_s']:.1f} tok/s, {figures['predicted_speedup']:.2f}x the target alone, measured in place"
    )
