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
    assert "| none | " in out and "NO" not in out
    assert "| - / - | yes |" in out  # no drafter pre-drafts in the first row: no hit rate, not 0%


def test_the_placements_name_the_drafters_that_pre_draft():
    assert predraft_placement.placements(4) == {"none": (), "first": (0,), "last": (2,), "all": (0, 1, 2)}
    config = predraft_placement.config_for(3, 0.1, 8, (1,))
    assert [s.predraft for s in config.stages] == [0, 8, 0]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--depth", "1"], "--depth"),
        (["--depth", "5"], "--depth"),
        (["--time-scale", "0"], "--time-scale"),
        (["--rounds", "0"], "--rounds"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        predraft_placement.main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err.split("error:")[1]  # in the error, not only in the usage line


def test_a_round_that_changed_a_token_is_not_exact():
    same = ((1, 2), (3,))
    sides = [
        predraft_placement.Side("none", (1.0,), (None,), (same,)),
        predraft_placement.Side("all", (1.0, 1.0), (0.4,), (same, ((1, 2), (4,)))),
    ]
    assert not predraft_placement.exact(sides) and predraft_placement.exact(sides[:1])
