"""experiments.pair_model: a pair of sleeping mocks measured beside the formula and the chain model."""

from __future__ import annotations

import json

import pytest

from experiments import pair_model
from experiments.pair_model import Verifier, measure, render
from pipespec.planning.analytical import async_step, chain_rates_with_verify_cost

TINY = Verifier(4.0, 0.1, 6, (1.0,), (0.7,))


@pytest.fixture(scope="module")
def point():
    return measure(TINY, 1.0, 0.7, runs=1, tokens=24)


def test_a_point_holds_what_was_asked_and_what_was_measured(point):
    assert (point.verifier_ms, point.drafter_ms, point.lookahead, point.agreement) == (4.0, 1.0, 6, 0.7)
    assert 0.0 < point.alpha < 1.0
    assert point.verifier_step_ms >= 4.0 and point.drafter_step_ms >= 1.0  # a sleep lasts at least what it asks
    assert point.tokens_per_s > 0 and point.sync_tokens_per_s > 0 and point.sync_window in pair_model.SYNC_WINDOWS


def test_the_model_is_the_formula_held_to_the_drafter_bound(point):
    drafter_s, verifier_s = point.drafter_step_ms / 1e3, point.verifier_step_ms / 1e3
    block_s = verifier_s + (pair_model.BLOCK - 1) * TINY.per_token_ms / 1e3
    step = async_step(point.alpha, 3, 1 / drafter_s, verifier_s, block_s, pair_model.BLOCK)
    assert point.formula_tokens_per_s == pytest.approx(step.tokens / step.seconds)
    model = chain_rates_with_verify_cost([drafter_s, verifier_s], [drafter_s, block_s], pair_model.BLOCK, [point.alpha], [3])
    assert point.model_tokens_per_s == pytest.approx(model[-1]) and point.model_tokens_per_s <= point.formula_tokens_per_s
    assert point.as_dict()["model_gap"] == pytest.approx(point.tokens_per_s / point.model_tokens_per_s - 1)


def test_main_writes_the_table_and_the_json(point, tmp_path, monkeypatch):
    monkeypatch.setattr(pair_model, "GRID", (TINY,))
    monkeypatch.setattr(pair_model, "measure", lambda *args: point)
    assert pair_model.main(["--out", str(tmp_path), "--runs", "1"]) == 0
    [row] = json.loads((tmp_path / "pair_model.json").read_text())
    assert row["tokens_per_s"] == point.tokens_per_s
    text = (tmp_path / "pair_model.md").read_text()
    assert text == render([point]) and "| 4 (" in text and "over 1 points" in text


def test_bad_runs_are_refused_naming_the_value(tmp_path, capsys):
    with pytest.raises(SystemExit):
        pair_model.main(["--out", str(tmp_path), "--runs", "0"])
    assert "--runs and --tokens must be at least 1, got 0" in capsys.readouterr().err
