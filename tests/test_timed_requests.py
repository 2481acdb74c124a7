"""Timed requests (`pipespec.cli.timed_requests`): the warm-up repeats until every stage has made a
forward, and gives up with a warning after WARM_UP_TRIES; the rate is tokens over seconds end to end.
The client here is a stand-in that returns canned statistics: `serving` on a real pipeline runs in
test_cli_demo and test_scaling."""

from __future__ import annotations

import logging

from pipespec.cli.timed_requests import WARM_UP_TRIES, tokens_per_s, warm
from pipespec.protocol.stats import RequestStats, StageStats
from pipespec.requests.outputs import Generation


def generation(tokens: int, *forwards: int) -> Generation:
    stages = [StageStats(f"s{i}", forwards=f) for i, f in enumerate(forwards)]
    return Generation(list(range(tokens)), "", "length", RequestStats(3, tokens, 0.1, 0.1, [], stages))


class CannedClient:
    """Answers each generate with the next of `answers` (the last one again once they run out)."""

    def __init__(self, *answers: Generation) -> None:
        self.answers = list(answers)
        self.requests: list[dict] = []

    def generate(self, **request) -> Generation:
        self.requests.append(request)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_warm_up_repeats_until_every_stage_has_forwarded():
    client = CannedClient(generation(4, 0, 3), generation(4, 0, 3), generation(4, 2, 3), generation(4, 0, 3))
    warm(client, {"prompt": "hi", "max_new_tokens": 64})
    assert client.requests == [{"prompt": "hi", "max_new_tokens": 4}] * 3


def test_warm_up_gives_up_with_a_warning_naming_the_cold_stage(caplog):
    client = CannedClient(generation(4, 0, 3))
    with caplog.at_level(logging.WARNING):
        warm(client, {"prompt": "hi"})
    assert len(client.requests) == WARM_UP_TRIES
    assert "['s0'] made no forward" in caplog.text


def test_tokens_per_s_is_tokens_over_seconds_end_to_end():
    assert tokens_per_s([(generation(6, 1), 2.0), (generation(2, 1), 2.0)]) == 2.0
