"""Draining a server told to stop (SIGTERM, SIGINT: pipespec.cluster.launch): no stream is cut without a word.

    begin_drain(coordinator)                  # new requests refused from now on, naming the drain
    cut = await drain(coordinator, grace_s)   # running requests finish, for up to grace_s; -> how many did not

While the server drains, `Coordinator.refusal()` (and so `Serving.refusal()` and readiness) says so:
a new request gets HTTP 503 or gRPC UNAVAILABLE naming the drain, `/health` and grpc.health.v1 say
not serving. A request still running when the grace is over ends like a request that fails in the
pipeline, with an error naming the drain: over HTTP an error event then `data: [DONE]`, over gRPC an
UNAVAILABLE status (pipespec.transport.coordinator_service). The caller then stops its servers
gracefully (pipespec.cluster.actors.CoordinatorActor.drain), so that these last events reach their
clients before the process goes. Torch-free, on the coordinator's event loop.
"""

from __future__ import annotations

import asyncio
import logging

from pipespec.serving.coordinator import Coordinator

log = logging.getLogger(__name__)

DRAINING = "the server is shutting down: it finishes the requests it has and takes no new ones"
CLOSE_S = 5.0  # how long the requests the drain ends get to be closed on every stage


def begin_drain(coordinator: Coordinator) -> None:
    """Refuse new requests from now on, naming the drain; those running go on."""
    if coordinator.draining is None:
        log.info("draining: %d requests running, no new ones taken", len(coordinator.live))
        coordinator.draining = DRAINING


async def drain(coordinator: Coordinator, grace_s: float) -> int:
    """Refuse new requests (`begin_drain`), let the running ones finish for up to `grace_s` seconds, then
    end each one left with an error naming the drain. -> how many were ended so."""
    begin_drain(coordinator)
    if await _idle(coordinator, grace_s):
        return 0
    left = [rid for rid, live in coordinator.live.items() if live.finish_reason is None]
    why = f"the server shut down before the request finished: it let running requests finish for {grace_s:g} s (--drain-seconds)"
    log.warning("draining: %d requests still running after %g s end with an error", len(left), grace_s)
    for rid in left:
        coordinator.fail(rid, why)
    if not await _idle(coordinator, CLOSE_S):  # their clients still get their error: completed without those stages
        log.warning("draining: %d requests not closed on every stage within %g s: ended now", len(coordinator.live), CLOSE_S)
        for rid in list(coordinator.live):
            coordinator.complete_now(rid)
    return len(left)


async def _idle(coordinator: Coordinator, timeout_s: float) -> bool:
    """Whether no request is live within `timeout_s` seconds."""
    try:
        await asyncio.wait_for(coordinator.idle.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
