"""dev/draft_ranks.py: it measures, on mock stages, the agreement and runner-up rates they are built with."""

from __future__ import annotations

from collections import Counter

from dev.draft_ranks import _answer_ranks, markdown, summary
from experiments.bench_engine import spec
from pipespec import load_config
from pipespec.engine.synchronous import generate_sync
from pipespec.stages.build import load_stages


def test_the_ranks_measured_on_mocks_are_the_rates_they_are_built_with():
    drafter = {"name": "d", "kind": "mock", "agreement": 0.6, "runner_up": 0.9, "vocab_size": 64}
    d, t = load_stages(load_config({"stages": [drafter, {"name": "t", "kind": "mock", "vocab_size": 64}]}))
    counts = Counter()
    for i in range(8):
        request = spec((1 + i, 2 * i + 3, 5), 200, i)
        counts.update(_answer_ranks(d, request, generate_sync(t, request).token_ids))
    row = summary("d", counts)
    assert row["positions"] == 1600
    assert 0.55 < row["rank_share"]["1"] < 0.65
    assert 0.82 < row["runner_up_given_rejection"] < 0.96  # 0.9 * 63/64 + 0.1/64
    assert "| d | 1600 |" in markdown([row], "header")
