"""Requests timed as a client sees them: a config served on the running Ray, streamed to, timed.

`serving` starts a config's pipeline and yields a `Client` to it once a warm-up request has gone
through every stage; `timed` streams one request (from a `Client` or a `LocalPipeline`) and times it
from the call to its last delta; `time_requests` does both for a list of requests. `pipespec demo`,
the planner's trials (pipespec.cli.trials) and the experiments measure with them, so that what one
of them predicts and what another measures are the same quantity: whole requests, prefill included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pipespec.client import Client
from pipespec.cluster.pipeline import start_pipeline
from pipespec.config import PipelineConfig
from pipespec.requests.outputs import Delta, Generation

Run = tuple[Generation, float]  # an answer and the seconds it took
OnText = Callable[[str], None]  # shows text as it comes

log = logging.getLogger(__name__)

WARM_UP_TRIES = 5  # warm-up requests at most, until every stage has made a forward for one


@contextmanager
def serving(config: PipelineConfig, warm_up: dict[str, Any]) -> Iterator[Client]:
    """Serve `config` on the running Ray; yield a `Client` to it once `warm_up` (a request's keywords) has
    gone through every stage; stop the pipeline on exit."""
    running = start_pipeline(config)
    try:
        with Client(running.address) as client:
            warm(client, warm_up)
            yield client
    finally:
        running.stop()


def warm(client: Client, request: dict[str, Any]) -> None:
    """Send `request` (4 tokens long) until every stage has made a forward for one: a drafter's first
    forward in its process is slow (lazy initialisation), and the target may finish a short request
    before it; a request timed after that would find the drafter cold, or not see it at all."""
    for _ in range(WARM_UP_TRIES):
        stages = client.generate(**{**request, "max_new_tokens": 4}).stats.stages
        cold = [s.stage for s in stages if s.forwards == 0]
        if not cold:
            return
    log.warning("stages %s made no forward in %d warm-up requests; timing them cold", cold, WARM_UP_TRIES)


def timed(stream: Callable[..., Iterator[Delta]], request: dict[str, Any], on_text: OnText | None = None) -> Run:
    """Stream one request (`Client.stream` or `LocalPipeline.stream`) -> (its Generation, seconds);
    `on_text` is given each delta's text as it comes."""
    start = time.perf_counter()
    deltas = []
    for delta in stream(**request):
        deltas.append(delta)
        if on_text is not None:
            on_text(delta.text)
    return Generation.from_deltas(deltas), time.perf_counter() - start


def time_requests(config: PipelineConfig, requests: Sequence[dict[str, Any]]) -> list[Run]:
    """Serve `config` on the running Ray, warm it up, then stream `requests` one after another
    (keyword dicts for `Client.stream`); -> [(Generation, seconds)]."""
    with serving(config, requests[0]) as client:
        return [timed(client.stream, request) for request in requests]


def tokens_per_s(runs: Sequence[Run]) -> float:
    """Tokens generated over the seconds the requests took, end to end."""
    return sum(len(g.token_ids) for g, _ in runs) / sum(s for _, s in runs)
