"""The coordinator's gRPC front end: `Generate` streams a request's deltas to a client.

Every way in shares one `Serving` (pipespec.serving.serving): a request is admitted by the front
door, the same code and messages as `LocalPipeline` and the HTTP server (a bad value or a value over
one of the config's `limits` comes back as an `error` response naming it, without a request id:
`generate_response.refusal`), then streamed as `chunk`s
and one `finished` carrying the statistics. A client that disconnects
cancels its handler, which aborts the request: the coordinator closes it on every stage at once.

Bounded per client: a connection (`context.peer()`) with `limits.requests_per_client` requests in
flight has its next `Generate` refused with RESOURCE_EXHAUSTED naming the limit (a gRPC status, not
an `error` response: it says "later", not "this request is wrong"), and the server reads no request
larger than the limits allow (`request_bytes`). `Cancel` acts only for the connection that opened
the request or a caller holding the pipeline's secret (pipespec.transport.auth); anyone else, or an
id that names no request, gets `cancelled=False` and nothing happens. `Health` says "serving", or
"not_serving: <why>" while `serving.trouble()` says why (the stages not linked yet, a stage lost);
the same readiness answers grpc.health.v1 on the same server (pipespec.transport.health), open to
anyone like `Generate`.

While the server drains to shut down (pipespec.serving.drain), a new `Generate` is refused with
UNAVAILABLE naming the drain, and a request that ends in an error meanwhile (the drain's grace ran out)
ends with an UNAVAILABLE status carrying its message, a status a client may retry elsewhere.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import grpc

from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.requests.frontdoor import request_bytes
from pipespec.serving.serving import Serving
from pipespec.transport.auth import authorized
from pipespec.transport.generate_request import from_proto
from pipespec.transport.generate_response import refusal, to_responses
from pipespec.transport.health import COORDINATOR_SERVICE, add_health, health_status
from pipespec.transport.streams import SERVER_OPTIONS


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, serving: Serving, name: str | None = None, secret: str | None = None):
        """`name`: what `Health` answers with (default: the pipeline's, `serving.model`); `secret`: the
        pipeline's (pipespec.transport.auth); a `Cancel` carrying it may cancel any request."""
        self.serving = serving
        self.name = serving.model if name is None else name
        self.secret = secret
        self.limits = serving.front_door.config.limits
        self._in_flight: Counter[str] = Counter()  # per client connection (context.peer())
        self._opened_by: dict[str, str] = {}  # request id -> the connection that opened it

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        peer, most = context.peer(), self.limits.requests_per_client
        coordinator = self.serving.coordinator
        if coordinator.draining is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, coordinator.draining)
        if self._in_flight[peer] >= most:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this connection has {most} requests in flight already, limits.requests_per_client ({most})",
            )
        self._in_flight[peer] += 1
        try:
            async with contextlib.aclosing(self._generate(request, peer)) as responses:
                async for response in responses:
                    if coordinator.draining is not None and response.request_id and response.WhichOneof("kind") == "error":
                        await context.abort(grpc.StatusCode.UNAVAILABLE, response.error.message)
                    yield response
        finally:
            self._in_flight[peer] -= 1
            if not self._in_flight[peer]:
                del self._in_flight[peer]

    async def _generate(self, request: pb.GenerateRequest, peer: str) -> AsyncIterator[pb.GenerateResponse]:
        try:
            admitted = await self.serving.admit(lambda: from_proto(request))
        except ValueError as e:
            yield refusal(str(e))
            return
        rid = admitted.spec.request_id
        self._opened_by[rid] = peer
        try:
            async for delta in self.serving.stream(admitted):
                for response in to_responses(rid, delta):
                    yield response
        finally:
            del self._opened_by[rid]

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelReply:
        rid = request.request_id
        allowed = self._opened_by.get(rid) == context.peer() or (self.secret is not None and authorized(context, self.secret))
        coordinator = self.serving.coordinator
        if not allowed or rid not in coordinator.live:
            return pb.CancelReply(cancelled=False)
        coordinator.abort(rid)
        return pb.CancelReply(cancelled=True)

    async def Health(self, request, context) -> pb.HealthReply:
        status = health_status(self.serving.trouble())
        return pb.HealthReply(name=self.name, status=status, requests=len(self.serving.coordinator.live))


async def serve_coordinator(service: CoordinatorService, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve `service` and grpc.health.v1 (ready while `service.serving.trouble()` is None) on host:port
    (0: any free port). -> (server, bound port)."""
    most = ("grpc.max_receive_message_length", request_bytes(service.limits))
    server = grpc.aio.server(options=[option for option in SERVER_OPTIONS if option[0] != most[0]] + [most])
    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    add_health(server, COORDINATOR_SERVICE, service.serving.trouble)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the coordinator's gRPC server to {host}:{port}")
    await server.start()
    return server, bound
