"""experiments.runtime_overhead: the target alone, layer by layer, and a wake-up's price across cores."""

from __future__ import annotations

import os
import re
import threading

import pytest

from experiments.runtime_overhead import main, placed, round_trip_us

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores and Linux"
)


def test_the_compute_threads_go_to_one_core_and_the_rest_to_the_other_then_back():
    allowed = os.sched_getaffinity(0)
    first, second = sorted(allowed)[:2]
    stop = threading.Event()
    device = threading.Thread(target=stop.wait, name="device-target_0", daemon=True)
    device.start()
    try:
        with placed(first, second):
            assert os.sched_getaffinity(device.native_id) == {first}
            assert os.sched_getaffinity(0) == {second}  # this thread: not a device's
        assert os.sched_getaffinity(device.native_id) == allowed and os.sched_getaffinity(0) == allowed
    finally:
        stop.set()


def test_a_round_trip_is_timed_on_one_core_and_across_two():
    allowed = os.sched_getaffinity(0)
    first, second = sorted(allowed)[:2]
    for peer in (first, second):
        timed = re.fullmatch(r"(\d+) us \(p90 (\d+)\)", round_trip_us(first, peer, 0.1, trips=20))
        assert timed and 0 < int(timed[1]) <= int(timed[2])  # a round trip through the kernel takes a microsecond at least
    assert os.sched_getaffinity(0) == allowed  # this thread back where it was


@pytest.mark.ray
@pytest.mark.slow
def test_every_layer_answers_the_demo_prompts_beside_the_decode_loop(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        main(["--limit", "1", "--rounds", "1", "--max-new-tokens", "4", "--log-level", "WARNING"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| ([a-zA-Z ,]+) \| [\d.]+ \| [\d, ]+ \| ([\d.]+)x \|$", out, re.M))
    assert list(rows) == ["decode loop", "runtime, one core", "runtime, loop on another core", "Ray actor"]
    assert rows["decode loop"] == "1.00" and all(float(x) > 0 for x in rows.values())
    assert len(re.findall(r"^\| [\d.]+ ms \| \d+ us \(p90 \d+\) \| \d+ us \(p90 \d+\) \|$", out, re.M)) == 4
