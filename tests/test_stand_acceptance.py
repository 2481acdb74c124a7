"""experiments.stand_acceptance on the demo models, a few short answers: every side's row, greedy answers exact,
and STAND's later answers to a question it has seen accept more than its first."""

from __future__ import annotations

import json

import pytest

from experiments import stand_acceptance


@pytest.mark.slow
def test_every_side_answers_exactly_and_stand_learns(tmp_path):
    stand_acceptance.main(["--limit", "2", "--samples", "2", "--tokens", "24", "--modes", "greedy", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "stand_acceptance.json").read_text())["rows"]
    assert [r["side"] for r in rows] == ["ngram chain", "stand chain", "stand tree", "tiny chain", "tiny tree"]
    assert all(r["exact"] == "4/4" for r in rows)
    stand = rows[1]
    assert stand["later_answers"] > stand["first_answers"]
    assert (tmp_path / "stand_acceptance.md").read_text().startswith("# STAND against prompt lookup and tiny")
