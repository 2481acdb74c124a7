"""dev.host_work: host work per target step at each depth, read from the trace and the threads' CPU."""

from __future__ import annotations

import time

import pytest

from dev.host_work import main

pytestmark = pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="reads the loop thread's CPU clock")


def test_each_depth_is_a_row_whose_deeper_chains_handle_more_messages_per_target_step(capsys):
    assert main(["--depths", "1", "2", "--time-scale", "0.01", "--rounds", "1", "--tokens", "16", "--log-level", "WARNING"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| 70B") or line.startswith("| 8B")]
    assert [r[0].strip() for r in rows] == ["70B", "8B -> 70B"]
    alone, pair = ([float(x) for x in r[1:]] for r in rows)
    # alone: a finished forward per step (and the prefill's); the pair adds the drafter's forwards, drafts and verdicts
    assert 1 <= alone[1] < 3 < pair[1]
    for steps, _, loop_ms, process_ms, machine_ms, tokens_per_s, loop_us in (alone, pair):
        assert steps > 0 and 0 < loop_ms <= process_ms and machine_ms > 0 and tokens_per_s > 0
        assert loop_us > 0


def test_a_depth_past_the_chain_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--depths", "5"])
    assert exit_.value.code == 2 and "--depths: 5 is not within 1..4" in capsys.readouterr().err
