"""gRPC links: the in-process `Link` interface over long-lived bidirectional streams.

A stage serves `Stage.Link` (its drafter connects and streams
drafts; verdicts come back on the same stream) and `Stage.Control` (the coordinator connects: opens
and closes go down, commits, statistics and failures come up). Each message is one msgpack frame
(pipespec.codec). `send` never blocks the event loop: it queues the frame and a writer awaits gRPC's
flow control, so a slow peer holds back the writer, not the runner; the queue stays small because
the protocol bounds what is in flight (lookahead per request). Message limits are raised for
q rows and hidden states; keepalive pings detect a dead peer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from pipespec import codec
from pipespec.messages import Message
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pipespec.runner import StageRunner

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 512 * 2**20
_LIMITS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
CHANNEL_OPTIONS = _LIMITS + [  # clients ping an idle stream every 20 s to detect a dead peer
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = _LIMITS + [  # ... and servers accept those pings instead of answering GOAWAY
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]

_END = None  # queued to end a stream


class StreamLink:
    """A Link whose messages leave through a gRPC stream (either side of it)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    def send(self, message: Message) -> None:
        self.queue.put_nowait(codec.encode(message))

    def close(self) -> None:
        self.queue.put_nowait(_END)

    async def frames(self) -> AsyncIterator[pb.Frame]:
        while (payload := await self.queue.get()) is not _END:
            yield pb.Frame(payload=payload)


async def _pump(frames: AsyncIterator[pb.Frame], deliver: Callable[[Message], None], what: str) -> None:
    """Deliver every incoming frame until the stream ends."""
    try:
        async for frame in frames:
            deliver(codec.decode(frame.payload))
    except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
        log.debug("%s stream ended: %s", what, e)


class StageService(pb_grpc.StageServicer):
    """Serves one stage runner: its drafter's stream and the coordinator's stream."""

    def __init__(self, runner: StageRunner) -> None:
        self.runner = runner
        self.drafter_attached = asyncio.Event()
        self.coordinator_attached = asyncio.Event()

    async def Link(self, request_iterator, context) -> AsyncIterator[pb.Frame]:
        """The drafter's stream becomes the runner's upstream link."""
        link = StreamLink()
        self.runner.connect(upstream=link)
        self.drafter_attached.set()
        async for frame in self._serve(link, request_iterator, "upstream"):
            yield frame

    async def Control(self, request_iterator, context) -> AsyncIterator[pb.Frame]:
        """The coordinator's stream becomes the runner's coordinator link."""
        link = StreamLink()
        self.runner.connect(coordinator=link)
        self.coordinator_attached.set()
        async for frame in self._serve(link, request_iterator, "coordinator"):
            yield frame

    async def _serve(self, link: StreamLink, incoming, role: str) -> AsyncIterator[pb.Frame]:
        """Deliver what comes in to the runner; stream out what it sends on `link`."""
        reader = asyncio.create_task(_pump(incoming, self.runner.deliver, f"{self.runner.name} {role}"))
        reader.add_done_callback(lambda _: link.close())
        async for frame in link.frames():
            yield frame

    async def attached(self, drafter: bool | None = None) -> None:
        """Return once the coordinator and, if `drafter` (default: the runner has one), its drafter have
        connected (a drafter on the same device is linked in process, not here)."""
        await self.coordinator_attached.wait()
        if self.runner.drafter_name is not None if drafter is None else drafter:
            await self.drafter_attached.wait()

    async def Health(self, request, context) -> pb.HealthReply:
        return pb.HealthReply(name=self.runner.name, status="serving", requests=len(self.runner.requests))


async def serve_stage(runner: StageRunner, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int, StageService]:
    """Start a gRPC server for `runner`; -> (server, bound port, service)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    service = StageService(runner)
    pb_grpc.add_StageServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind a gRPC server to {host}:{port}")
    await server.start()
    return server, bound, service


class StageClient:
    """Client side of a stage's streams: what its drafter and the coordinator hold."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.StageStub(self.channel)
        self.tasks: list[asyncio.Task] = []
        self.links: list[StreamLink] = []

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    def _open(self, method, deliver: Callable[[Message], None], what: str) -> StreamLink:
        link = StreamLink()
        call = method(link.frames())
        self.links.append(link)
        self.tasks.append(asyncio.create_task(_pump(call, deliver, what)))
        return link

    def link(self, deliver: Callable[[Message], None]) -> StreamLink:
        """Open the drafter stream: send drafts on the returned link; verdicts go to `deliver`."""
        return self._open(self.stub.Link, deliver, f"{self.address} -> drafter")

    def control(self, deliver: Callable[[Message], None]) -> StreamLink:
        """Open the coordinator stream: send opens and closes; commits etc. go to `deliver`."""
        return self._open(self.stub.Control, deliver, f"{self.address} -> coordinator")

    async def health(self) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=5.0)

    async def close(self) -> None:
        for link in self.links:  # end our request streams, then stop reading theirs
            link.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.channel.close()
