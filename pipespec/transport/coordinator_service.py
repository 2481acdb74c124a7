"""The coordinator's gRPC front end: `Generate` streams a request's deltas to a client.

A request is validated by the front door (a bad value comes back as an `error` response naming it),
then streamed as `chunk`s and one `finished` carrying the statistics. A client that disconnects
cancels its handler, which aborts the request: the coordinator closes it on every stage at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pipespec import codec
from pipespec.coordinator import Coordinator
from pipespec.frontdoor import FrontDoor
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.transport.generate_request import from_proto
from pipespec.transport.streams import SERVER_OPTIONS


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator, front_door: FrontDoor, name: str = "coordinator", secret: str | None = None):
        self.coordinator = coordinator
        self.front_door = front_door
        self.name = name
        self.secret = secret  # the pipeline's (pipespec.transport.auth)

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        try:
            # off the loop: an image runs through the processor
            spec, stop = await asyncio.to_thread(self.front_door.request, from_proto(request))
        except ValueError as e:
            yield pb.GenerateResponse(error=pb.Error(message=str(e)))
            return
        rid = spec.request_id
        async for delta in self.coordinator.generate(spec, stop):
            if delta.text or delta.token_ids:
                yield pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(text=delta.text, token_ids=delta.token_ids))
            if delta.finish_reason == "error":
                yield pb.GenerateResponse(request_id=rid, error=pb.Error(message=delta.error or "error"))
            elif delta.finish_reason is not None:
                finished = pb.Finished(finish_reason=delta.finish_reason, stats=codec.encode(delta.stats))
                yield pb.GenerateResponse(request_id=rid, finished=finished)

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelReply:
        live = request.request_id in self.coordinator.live
        self.coordinator.abort(request.request_id)
        return pb.CancelReply(cancelled=live)

    async def Health(self, request, context) -> pb.HealthReply:
        return pb.HealthReply(name=self.name, status="serving", requests=len(self.coordinator.live))


async def serve_coordinator(service: CoordinatorService, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the coordinator's gRPC server to {host}:{port}")
    await server.start()
    return server, bound
