"""pipespec.transport.generate_response: a request's statistics survive the trip through protobuf."""

from __future__ import annotations

from dataclasses import fields

from pipespec.protocol.stats import PairStats, RequestStats, StageStats
from pipespec.transport.generate_response import stats_from_proto, stats_to_proto


def test_every_statistic_but_a_stages_kv_use_goes_through_protobuf():
    stage = StageStats("dream", **{f.name: i + 1 for i, f in enumerate(fields(StageStats)[1:]) if f.name != "kv_use"})
    pair = PairStats("tiny", "dream", 3, 9, 5, 2, [3, 2], 14)
    stats = RequestStats(12, 7, 0.25, 0.5, [pair], [stage])
    assert stats_from_proto(stats_to_proto(stats)) == stats
