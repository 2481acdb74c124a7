"""The scaling sweep (`experiments.scaling`): the emulated sweep runs for 1..3 devices at a tiny time
scale, its predictions come from the chain model, its pipelines commit exactly the target alone's
tokens, and it writes the table, the JSON and the plot. The real sweep (demo models on Ray) runs once,
small, where the models are shipped."""

from __future__ import annotations

import json

import pytest

from experiments import scaling
from experiments.scaling import CHAIN, ScalingRow
from pipespec.planning.analytical import chain_rates
from pipespec.stages.build import load_stages

TOKENS = 16


@pytest.fixture(scope="module")
def rows() -> list[ScalingRow]:
    return scaling.emulated_sweep(3, time_scale=0.01, lookahead=8, tokens=TOKENS, runs=1)


def test_emulated_sweep_covers_one_to_three_devices(rows):
    assert [r.devices for r in rows] == [1, 2, 3]
    assert [r.chain for r in rows] == ["70B", "8B -> 70B", "1B -> 8B -> 70B"]
    assert all(r.sweep == "emulated" and r.exact for r in rows)
    assert [len(r.alphas) for r in rows] == [0, 1, 2]
    # alphas are measured: a pair whose drafts all went stale under a loaded machine has no trials (0.0)
    assert all(0.0 <= a <= 1.0 for r in rows for a in r.alphas) and any(a > 0 for r in rows for a in r.alphas)
    assert rows[0].sync_tokens_per_s is None and all(r.sync_tokens_per_s > 0 and r.sync_best for r in rows[1:])
    assert rows[0].speedup == rows[0].predicted_speedup == 1.0


def test_predictions_come_from_the_chain_model(rows):
    for r in rows:
        models = CHAIN[-r.devices :]
        latencies = [m.latency_ms / 1000.0 for m in models]
        # the model takes each stage's traced seconds per step: at least the sleep asked
        assert all(f >= lat * 1e3 for f, lat in zip(r.step_ms, latencies, strict=True))
        measured = [f / 1e3 for f in r.step_ms]
        windows = [4] * (r.devices - 1)  # half the drafters' lookahead of 8
        assert r.predicted_tokens_per_s == pytest.approx(chain_rates(measured, r.alphas, windows)[-1])
        if r.devices == 1:
            continue
        configured = [m.agreement for m in models[:-1]]
        assert r.configured_tokens_per_s == pytest.approx(chain_rates(latencies, configured, windows)[-1])
        assert r.predicted_speedup == pytest.approx(r.predicted_tokens_per_s / rows[0].predicted_tokens_per_s)


@pytest.mark.parametrize("predraft", [0, 3])
def test_pipeline_commits_exactly_the_target_alone(predraft):
    """Zero latency: the most asynchrony (and rollbacks) the runtime can get; still the target's tokens,
    with branches pre-drafted or without."""
    run = scaling.run_chain(CHAIN[-3:], time_scale=0.0, lookahead=8, tokens=TOKENS, runs=1, predraft=predraft)
    [target] = load_stages(scaling.emulated_config(CHAIN[-1:], time_scale=0.0, lookahead=8))
    alone = scaling.target_alone_outputs(target, TOKENS)
    assert [len(ids) for ids in alone] == [TOKENS] * len(alone)
    assert run.outputs == alone
    assert len(set(map(tuple, alone))) == len(alone)  # the prompts lead to different answers
    *drafters, target = run.config.stages
    assert all(s.predraft == predraft for s in drafters) and target.predraft == 0
    for stats in run.drafters:  # the middle stage too: its branches reach its drafter in its verdicts
        assert (stats.predraft_hits + stats.predraft_misses > 0) == (predraft > 0)  # verdicts met with the cache


def test_predicted_rate_by_hand():
    # Ample supply: drafter 100 tok/s, target 0.1 s, alpha 0.5, window 4 (n = min(4, 10) = 4):
    # rho = 0.5 / (1 - 0.5^5 + 0.5) = 0.340426; E[accepted] = (1 - 0.5^5) / 0.5 = 1.9375;
    # E[N] = (1 - rho) + rho * 1.9375 = 1.319149 tokens per 0.1 s. Its drafter could supply more:
    # 1 / (0.01 + 0.5 * 1.25 * 0.1) = 13.79 tokens a second.
    assert scaling.predicted_tokens_per_s([0.01, 0.1], [0.5], [4]) == pytest.approx(13.19149, rel=1e-5)
    # Supply-limited: a perfect drafter at 20 tok/s supplies n = 2 drafts per 0.1 s target step, 3 tokens
    # a step by the chain formula; but it drafts every position, the bonus ones too: 20 tokens a second.
    assert scaling.predicted_tokens_per_s([0.05, 0.1], [1.0], [8]) == pytest.approx(20.0)
    assert scaling.predicted_tokens_per_s([0.1237], [], []) == pytest.approx(1 / 0.1237)


def test_gap_is_measured_over_predicted_minus_one():
    row = ScalingRow("emulated", 2, "8B -> 70B", 9.0, 10.0, 1.8, 2.0, (0.8,), True)
    assert row.gap == pytest.approx(-0.1)
    assert row.speedup_gap == pytest.approx(-0.1)
    assert row.as_dict()["gap"] == pytest.approx(-0.1)


def test_seconds_per_forward_names_a_stage_that_made_none():
    from tests.test_timed_requests import generation

    runs = [generation(4, 2, 4), generation(4, 3, 4)]
    for g, (tiny, target) in zip(runs, [(0.2, 0.4), (0.4, 0.8)]):
        g.stats.stages[0].compute_s, g.stats.stages[1].compute_s = tiny, target
    assert scaling.seconds_per_forward(runs) == pytest.approx([0.12, 0.15])
    with pytest.raises(ValueError, match=r"stages \['s0'\] made no forward in 1 requests"):
        scaling.seconds_per_forward([generation(4, 0, 4)])


def test_one_device_per_stage_from_the_cluster_resources():
    assert scaling.cluster_devices({"CPU": 2.0}) == ("num_cpus", 2)
    assert scaling.cluster_devices({"CPU": 16.0, "GPU": 4.0}) == ("num_gpus", 4)
    config = scaling.emulated_config(CHAIN[-2:], time_scale=0.0, lookahead=8)
    on_gpus = scaling.on_devices(config, "num_gpus")
    assert [(s.resources, s.device) for s in on_gpus.stages] == [({"num_gpus": 1}, "cuda")] * 2
    assert [s.resources for s in scaling.on_devices(config, "num_cpus").stages] == [{"num_cpus": 1}] * 2


def test_writes_table_json_and_plot(rows, tmp_path):
    text = scaling.write_outputs(rows, tmp_path, {"time_scale": 0.01})
    assert (tmp_path / "scaling.md").read_text() == text
    assert "| emulated | 3 | 1B -> 8B -> 70B |" in text and "emulated: tokens/s measured vs predicted" in text
    figures = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["devices"] for r in figures["rows"]] == [1, 2, 3]
    assert figures["rows"][1]["gap"] == pytest.approx(rows[1].gap)
    assert [m["name"] for m in figures["chain"]] == ["68M", "1B", "8B", "70B"]
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_without_the_real_sweep(tmp_path, capsys):
    argv = ["--devices", "2", "--time-scale", "0.01", "--tokens", "8", "--runs", "1", "--no-real", "--out", str(tmp_path)]
    assert scaling.main(argv) == 0
    assert "| emulated | 2 | 8B -> 70B |" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir()} == {"scaling.md", "scaling.json", "scaling.png"}


@pytest.mark.ray
@pytest.mark.slow
def test_real_sweep_on_ray():
    from tests.fixtures import DEMO_MODELS

    if not scaling.have_real_models(DEMO_MODELS):
        pytest.skip(f"no demo models under {DEMO_MODELS}")
    real = scaling.real_sweep(DEMO_MODELS, prompts=1, tokens=24)  # long enough that every drafter makes a forward
    assert [r.devices for r in real] == list(range(1, len(real) + 1)) and len(real) >= 2
    assert all(r.sweep == "real" and r.exact and r.tokens_per_s > 0 and r.predicted_tokens_per_s > 0 for r in real)
    assert len(real[1].alphas) == 1
