"""dev.train_cost: the demo target's training step against its arithmetic's floor on this machine."""

from __future__ import annotations

import re

from dev.train_cost import main, matmul_rate


def test_a_matmul_rate_is_measured():
    import torch

    assert matmul_rate(torch.float32, n=64, repeats=2) > 0


def test_each_variant_is_timed_beside_the_floor(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert (
            main(["--batch-size", "4", "--batches", "2", "--rounds", "1", "--steps", "10", "--eager-only", "--threads", "1"]) == 0
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    floor = re.search(r"(\d+) GFLOP a step; matrix products here: fp32 (\d+), bf16 (\d+) GFLOP/s", out)
    assert floor and all(int(x) > 0 for x in floor.groups())  # 4 conversations of ~35 tokens: a few GFLOP
    rows = re.findall(r"^\| ([a-z0-9 ()]+) \| (\d+) \| (\d+)% \| (\d+) min \|$", out, re.M)
    assert [r[0] for r in rows] == ["fp32 (the recipe)", "bf16 autocast"]  # the compiled ones left out
    assert all(int(ms) > 0 for _, ms, _, _ in rows)
