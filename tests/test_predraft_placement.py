"""experiments.predraft_placement: every placement of pre-drafting runs, changes no token, and is tabled."""

from __future__ import annotations

import pytest

from experiments import predraft_placement


def test_every_placement_runs_exactly_and_is_tabled(capsys):
    assert (
        predraft_placement.main(
            ["--depth", "3", "--time-scale", "0.002", "--rounds", "1", "--tokens", "12", "--log-level", "WARNING"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1B -> 8B -> 70B, time scale 0.002:" in out
    for side in ("none", "first", "last", "all"):
        assert f"| {side} |" in out
    assert "| none | " in out and "| 1.00x |" in out and "NO" not in out


def test_the_placements_name_the_drafters_that_pre_draft():
    assert predraft_placement.placements(4) == {"none": (), "first": (0,), "last": (2,), "all": (0, 1, 2)}
    config = predraft_placement.config_for(3, 0.1, 8, (1,))
    assert [s.predraft for s in config.stages] == [0, 8, 0]


@pytest.mark.parametrize("argv", [["--depth", "1"], ["--depth", "5"], ["--time-scale", "0"], ["--rounds", "0"]])
def test_bad_arguments_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        predraft_placement.main(argv)
    assert exit_.value.code == 2
    assert argv[0] in capsys.readouterr().err
