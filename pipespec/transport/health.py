"""Health: the standard `grpc.health.v1` service, and the pipespec `Health` reply's status, from an
endpoint's readiness.

    add_health(server, COORDINATOR_SERVICE, serving.trouble)             # the coordinator: open to all
    add_health(server, STAGE_SERVICE, service.trouble, secret=secret)    # a stage: the pipeline's secret

Readiness is a `trouble()` callable: None when the endpoint can serve, else why not (the coordinator:
`Serving.trouble`, every stage linked and none lost; a stage: `StageService.trouble`, its streams
attached and its links up). `Check` answers for the server as a whole ("") and for its one service
name (`pipespec.Coordinator`, `pipespec.Stage`): SERVING when `trouble()` is None, else NOT_SERVING;
any other name is NOT_FOUND. `Watch` sends the status at once, then each change; `List` gives both.

Derived, not pushed: readiness is computed from what the coordinator, the runner and the stream
service already keep (links connected, lost, attached), at the moment it is asked, so `Check` is
exact at call time and there is one source of truth. The library's servicer
(`grpc_health.v1.health.aio.HealthServicer`) would instead need a `set()` at every transition, i.e.
hooks in the coordinator, the runner and every stream's callbacks, and one missed transition would
make `Check` lie until the next. `Watch` polls `trouble()` every `WATCH_S` for as long as its caller
watches (a few attribute reads; nothing runs while nobody watches), so a change reaches a watcher
within that.

Who may ask: with `secret` (the stages', pipespec.transport.auth), a call without it is refused with
UNAUTHENTICATED before anything is read, like the stage's other calls; without (the coordinator's),
anyone, like its `Generate`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipespec.protos import pipespec_pb2 as pb
from pipespec.transport.auth import authorized

COORDINATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name  # "pipespec.Coordinator"
STAGE_SERVICE = pb.DESCRIPTOR.services_by_name["Stage"].full_name  # "pipespec.Stage"
OVERALL = ""  # grpc.health.v1's name for the server as a whole
WATCH_S = 0.1  # how often a `Watch` looks at the readiness again

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def health_status(trouble: str | None) -> str:
    """What the pipespec `Health` answers: "serving", or "not_serving: <why>" (an endpoint's `trouble()`)."""
    return "serving" if trouble is None else f"not_serving: {trouble}"


class HealthService(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for one server: "" and `service` are SERVING exactly while `trouble()` is None."""

    def __init__(self, service: str, trouble: Callable[[], str | None], secret: str | None = None) -> None:
        self.services = (OVERALL, service)
        self.trouble = trouble
        self.secret = secret

    def status(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus:
        if service not in self.services:
            return SERVICE_UNKNOWN
        return SERVING if self.trouble() is None else NOT_SERVING

    async def _admit(self, context) -> None:
        if not authorized(context, self.secret):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "health call without the pipeline's secret")

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        await self._admit(context)
        if request.service not in self.services:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r} here")
        return health_pb2.HealthCheckResponse(status=self.status(request.service))

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        await self._admit(context)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=self.status(name)) for name in self.services}
        )

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The status now, then each change, until the caller leaves (an unknown name: SERVICE_UNKNOWN,
        and the call stays open, as grpc.health.v1 asks)."""
        await self._admit(context)
        last = None
        while True:
            if (status := self.status(request.service)) != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_S)


def add_health(server: grpc.aio.Server, service: str, trouble: Callable[[], str | None], secret: str | None = None) -> None:
    """Serve grpc.health.v1 on `server` for "" and `service`, ready while `trouble()` is None; open to
    callers holding `secret` (None: to anyone)."""
    health_pb2_grpc.add_HealthServicer_to_server(HealthService(service, trouble, secret), server)
