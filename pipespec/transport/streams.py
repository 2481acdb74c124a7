"""gRPC links: the in-process `Link` interface over long-lived bidirectional streams.

A stage serves `Stage.Link` (its drafter connects and streams drafts; verdicts come back on the same
stream) and `Stage.Control` (the coordinator connects: opens and closes go down, commits, statistics
and failures come up). Each message is one msgpack payload (pipespec.protocol.codec); a gRPC frame carries
every payload queued since the last one went (what one `send_all` sent at least: a forward's drafts or
verdicts for all its requests), as many as fit `limits.frame_bytes`, and its reader delivers them as one.
`send` never blocks the event loop: it queues the payload and a writer awaits gRPC's flow control, so a
slow peer holds back the writer, not the runner; the queue stays small because the protocol bounds what
is in flight (lookahead per request).

Who may attach (design 5c): every call (Link, Control, Health, and grpc.health.v1's, which says
SERVING once the stage is linked: pipespec.transport.health) carries the pipeline's secret as
metadata (pipespec.transport.auth) and a call without it is refused with UNAUTHENTICATED before it
reads or sends anything. One attachment per role: a second drafter or coordinator stream while one is
live is refused with ALREADY_EXISTS (a stage whose drafter is linked in process, or that has none,
refuses every drafter stream); when a stream ends, for any reason, its role is free again, so a
restarted peer can attach.

Loss: when a stream ends other than by our own `close()` / `stop()`, the endpoint it fed is told
(`Inbox.lost(link)`), on the stage's side and on the client's, and a warning names the stage, the
role and why. Keepalive pings, both ways, declare a silent peer lost after about `detect_s` (the
config's `faults.detect_s`). Each payload is decoded against the config's limits; one the codec
refuses (`codec.FrameError`) is logged and dropped, and the frame's others and the stream go on. gRPC
refuses a message larger than `limits.frame_bytes` (and a little for the wrapper), which ends that stream. Servers never
share their port (no SO_REUSEPORT): a second server on a port in use fails to bind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from pipespec.config import FaultSpec, LimitsSpec
from pipespec.protocol import codec
from pipespec.protocol.links import Inbox, Unsent
from pipespec.protocol.messages import Close, Closed, Commit, Draft, Failed, Message, Open, TargetFeatures, Verdict
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.transport.auth import authorized, call_metadata
from pipespec.transport.health import STAGE_SERVICE, add_health, health_status

if TYPE_CHECKING:
    from pipespec.engine.runner import StageRunner

log = logging.getLogger(__name__)

WRAPPER_BYTES = 64 * 2**10  # what a Frame (or a GenerateRequest's other fields) adds to its payload
DRAFTER, COORDINATOR = "drafter", "coordinator"  # the roles that attach to a stage


def channel_options(limits: LimitsSpec = LimitsSpec(), detect_s: float = FaultSpec.detect_s) -> list[tuple[str, int]]:
    """A client's: messages up to a frame, a ping every detect_s / 2 answered within detect_s / 2."""
    return _sizes(limits) + _keepalive(detect_s)


def server_options(limits: LimitsSpec = LimitsSpec(), detect_s: float = FaultSpec.detect_s) -> list[tuple[str, int]]:
    """A server's: it pings its clients as they ping it, and accepts their pings (never GOAWAY for them)."""
    ping_ms = _ping_ms(detect_s)
    return (
        _sizes(limits)
        + _keepalive(detect_s)
        + [
            ("grpc.http2.min_ping_interval_without_data_ms", max(1, ping_ms // 2)),  # grpc's name for the min recv interval
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.so_reuseport", 0),
        ]
    )


def _ping_ms(detect_s: float) -> int:
    return max(1, round(detect_s * 500))


def _keepalive(detect_s: float) -> list[tuple[str, int]]:
    """Both sides ping every detect_s / 2 and declare the peer lost when an answer takes longer than that."""
    ping_ms = _ping_ms(detect_s)
    return [
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", ping_ms),
        ("grpc.http2.ping_timeout_ms", ping_ms),  # what grpc 1.85 actually waits for an answer (else a minute)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _sizes(limits: LimitsSpec) -> list[tuple[str, int]]:
    size = limits.frame_bytes + WRAPPER_BYTES
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


CHANNEL_OPTIONS = channel_options()  # the defaults, for the coordinator's clients and server
SERVER_OPTIONS = server_options()

_END = None  # queued to end a stream


class StreamLink:
    """A Link whose messages leave through a gRPC stream (either side of it). Once closed (by us, or
    because the stream ended) it drops what is sent: nothing piles up for a peer that is gone."""

    def __init__(self, limits: LimitsSpec) -> None:
        self.queue: asyncio.Queue[list[bytes] | None] = asyncio.Queue()  # payloads sent together
        self.closed = False
        self.limits = limits

    def send(self, message: Message) -> None:
        """Queue `message`; one larger than its kind's limit raises codec.FrameError (its request fails,
        not the stream: gRPC would end the stream for it, and the peer would refuse it anyway)."""
        if not self.closed:
            self.queue.put_nowait([self._encode(message)])

    def send_all(self, messages: Sequence[Message]) -> list[Unsent]:
        """Queue `messages` to go in one frame; those that cannot be encoded, or are over their kinds' limits, stay
        behind, each named with why."""
        payloads, unsent = [], []
        if self.closed:
            return unsent
        for message in messages:
            try:
                payloads.append(self._encode(message))
            except Exception as error:  # one that cannot be encoded, or too large: its request fails, not the stream
                unsent.append((message, error))
        if payloads:
            self.queue.put_nowait(payloads)
        return unsent

    def _encode(self, message: Message) -> bytes:
        payload = codec.encode(message)
        kind = type(message).__name__
        if len(payload) > (limit := codec.frame_limit(kind, self.limits)):
            raise codec.FrameError(f"a {kind} of {len(payload)} bytes is over the frame limit of {limit} (limits.frame_bytes)")
        return payload

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(_END)

    async def frames(self) -> AsyncIterator[pb.Frame]:
        """Every payload queued, in order, in as few frames as fit `limits.frame_bytes` (gRPC's message limit,
        beside the wrapper): whatever was queued while the last frame went rides in the next."""
        ended = False
        while not ended and (payloads := await self.queue.get()) is not _END:
            while not self.queue.empty():
                if (more := self.queue.get_nowait()) is _END:
                    ended = True
                    break
                payloads.extend(more)
            for frame in _frames(payloads, self.limits.frame_bytes):
                yield pb.Frame(payloads=frame)


_FIELD_BYTES = 8  # what protobuf adds to each payload of a Frame (its tag and length), at most


def _frames(payloads: list[bytes], budget: int) -> Iterator[list[bytes]]:
    """`payloads` in order, cut into runs of at most `budget` bytes with their fields' framing (a payload alone may
    be as large: the wrapper's allowance covers its framing)."""
    frame, size = [], 0
    for payload in payloads:
        if frame and size + len(payload) + _FIELD_BYTES > budget:
            yield frame
            frame, size = [], 0
        frame.append(payload)
        size += len(payload) + _FIELD_BYTES
    if frame:
        yield frame


# What each stream carries, by the side reading it: a message of another kind is dropped
FROM_DRAFTER = (Draft,)  # a verifier reads its drafter's drafts
FROM_VERIFIER = (Verdict, TargetFeatures)  # a drafter reads its verifier's verdicts (and a DREAM stage its features)
FROM_COORDINATOR = (Open, Close, Commit)  # a stage reads the coordinator's opens and closes (a STAND stage: commits)
FROM_STAGE = (Commit, Closed, Failed)  # the coordinator reads a stage's answers


async def _read(frames: AsyncIterator[pb.Frame], inbox: Inbox, limits: LimitsSpec, kinds: tuple[type, ...], what: str) -> None:
    """Deliver every incoming frame's messages of `kinds`, as one, until the stream ends; a payload the codec
    refuses, or of another kind, is logged and dropped (the frame's others are delivered)."""
    async for frame in frames:
        messages = []
        for payload in frame.payloads:
            try:
                message = codec.decode(payload, limits)
            except codec.FrameError as e:
                log.warning("%s: dropped a message: %s", what, e)
                continue
            if not isinstance(message, kinds):
                log.warning("%s: dropped a %s: this stream does not carry it", what, type(message).__name__)
                continue
            messages.append(message)
        if messages:
            inbox.deliver_all(messages)


class StageService(pb_grpc.StageServicer):
    """Serves one stage runner: its drafter's stream (unless `drafter` is False: its drafter is linked in
    process, or it has none) and the coordinator's stream, to callers holding `secret`."""

    def __init__(
        self,
        runner: StageRunner,
        secret: str | None = None,
        limits: LimitsSpec = LimitsSpec(),
        drafter: bool | None = None,
    ) -> None:
        self.runner = runner
        self.secret = secret
        self.limits = limits
        self.drafter = runner.drafter_name is not None if drafter is None else drafter
        self.live: dict[str, StreamLink] = {}  # role -> the link its live stream feeds
        self.drafter_attached = asyncio.Event()
        self.coordinator_attached = asyncio.Event()
        self.server: grpc.aio.Server | None = None
        self.stopping = False  # our own shutdown: streams that end now are not lost

    async def Link(self, request_iterator, context) -> AsyncIterator[pb.Frame]:
        """The drafter's stream becomes the runner's upstream link."""
        async for frame in self._serve(request_iterator, context, DRAFTER):
            yield frame

    async def Control(self, request_iterator, context) -> AsyncIterator[pb.Frame]:
        """The coordinator's stream becomes the runner's coordinator link."""
        async for frame in self._serve(request_iterator, context, COORDINATOR):
            yield frame

    async def _admit(self, context, role: str) -> None:
        if not authorized(context, self.secret):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, f"stage {self.runner.name!r}: {role} call without the pipeline's secret"
            )

    async def _serve(self, incoming, context, role: str) -> AsyncIterator[pb.Frame]:
        """Attach `role`: deliver what comes in to the runner; stream out what it sends on the link."""
        await self._admit(context, role)
        if role == DRAFTER and not self.drafter:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stage {self.runner.name!r} takes no drafter stream")
        if role in self.live:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"stage {self.runner.name!r}: a {role} stream is already attached"
            )
        link = self.live[role] = StreamLink(self.limits)
        if role == DRAFTER:
            self.runner.connect(upstream=link)
            self.drafter_attached.set()
        else:
            self.runner.connect(coordinator=link)
            self.coordinator_attached.set()
        what = f"stage {self.runner.name!r} {role} stream"
        reader = asyncio.create_task(
            _read(incoming, self.runner, self.limits, FROM_DRAFTER if role == DRAFTER else FROM_COORDINATOR, what)
        )
        reader.add_done_callback(lambda _: link.close())
        why = "cancelled (the peer went away)"
        try:
            async for frame in link.frames():
                yield frame
            why = _reason(reader)
        finally:
            reader.cancel()
            link.close()
            del self.live[role]  # free again; no await before the runner hears of its loss, so none attaches first
            if not self.stopping:
                log.warning("%s lost: %s", what, why)
                self.runner.lost(link)

    async def attached(self) -> None:
        """Return once the coordinator and, if this stage takes one, its drafter have connected."""
        await self.coordinator_attached.wait()
        if self.drafter:
            await self.drafter_attached.wait()

    def trouble(self) -> str | None:
        """None when this stage is linked and answering: the coordinator's stream attached, its
        drafter's too if it takes one, its verifier linked if it has one, and no link lost; else why
        not. What grpc.health.v1 answers (pipespec.transport.health)."""
        runner = self.runner
        if (lost := runner.trouble()) is not None:
            return lost
        served = [COORDINATOR, DRAFTER] if self.drafter else [COORDINATOR]
        missing = [role for role in served if role not in self.live]  # as the streams attach and end here
        if runner.depth > 0 and runner.downstream is None:  # our own stream to the verifier, or an in-process link
            missing.append("verifier")
        return f"stage {runner.name!r}: its {' and '.join(missing)} not linked" if missing else None

    async def Health(self, request, context) -> pb.HealthReply:
        """The same readiness grpc.health.v1 answers (`trouble()`), as "serving" or "not_serving: <why>"."""
        await self._admit(context, "health")
        status = health_status(self.trouble())
        return pb.HealthReply(name=self.runner.name, status=status, requests=len(self.runner.requests))

    async def stop(self) -> None:
        """Our own shutdown: stop serving; the streams it ends are not reported lost."""
        self.stopping = True
        if self.server is not None:
            await self.server.stop(grace=None)


def _reason(reader: asyncio.Task) -> str:
    """Why a stream's reader stopped, if it did."""
    if not reader.done():
        return "this stage closed it"
    if reader.cancelled():
        return "cancelled"
    error = reader.exception()
    return "the peer closed it" if error is None else f"{type(error).__name__}: {error}"


async def serve_stage(
    runner: StageRunner,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    secret: str | None = None,
    limits: LimitsSpec = LimitsSpec(),
    detect_s: float = FaultSpec.detect_s,
    drafter: bool | None = None,
) -> tuple[grpc.aio.Server, int, StageService]:
    """Start a gRPC server for `runner` on host:port (0: any free port), open to callers holding
    `secret` (None: to anyone); `drafter`: whether it takes a drafter stream (default: if the runner has
    a drafter). -> (server, bound port, service); `service.stop()` stops it."""
    server = grpc.aio.server(options=server_options(limits, detect_s))
    service = StageService(runner, secret, limits, drafter)
    service.server = server
    pb_grpc.add_StageServicer_to_server(service, server)
    add_health(server, STAGE_SERVICE, service.trouble, secret)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # grpc's "Failed to bind"
        raise OSError(f"stage {runner.name!r}: cannot bind a gRPC server to {host}:{port} ({e})") from None
    if bound == 0:
        raise OSError(f"stage {runner.name!r}: cannot bind a gRPC server to {host}:{port}")
    await server.start()
    return server, bound, service


class StageClient:
    """Client side of a stage's streams: what its drafter and the coordinator hold. Every call carries
    `secret`; a stream that ends other than by `close()` is reported to its endpoint (`Inbox.lost`)."""

    def __init__(
        self,
        address: str,
        *,
        secret: str | None = None,
        limits: LimitsSpec = LimitsSpec(),
        detect_s: float = FaultSpec.detect_s,
    ) -> None:
        self.address = address
        self.metadata = call_metadata(secret)
        self.limits = limits
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(limits, detect_s))
        self.stub = pb_grpc.StageStub(self.channel)
        self.tasks: list[asyncio.Task] = []
        self.links: list[StreamLink] = []
        self.closing = False

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    def link(self, inbox: Inbox) -> StreamLink:
        """Open the drafter stream: send drafts on the returned link; verdicts go to `inbox`."""
        return self._open(self.stub.Link, inbox, DRAFTER)

    def control(self, inbox: Inbox) -> StreamLink:
        """Open the coordinator stream: send opens and closes; commits etc. go to `inbox`."""
        return self._open(self.stub.Control, inbox, COORDINATOR)

    def _open(self, method, inbox: Inbox, role: str) -> StreamLink:
        link = StreamLink(self.limits)
        call = method(link.frames(), metadata=self.metadata)
        self.links.append(link)
        self.tasks.append(asyncio.create_task(self._follow(call, inbox, link, role)))
        return link

    async def _follow(self, call, inbox: Inbox, link: StreamLink, role: str) -> None:
        """Read the stream into `inbox` until it ends; unless we closed it, report `link` lost."""
        what = f"{role} stream to the stage at {self.address}"
        why = "its reader failed"  # an unexpected error, which the task raises
        try:
            await _read(call, inbox, self.limits, FROM_VERIFIER if role == DRAFTER else FROM_STAGE, what)
            why = "the stage ended it"
        except grpc.aio.AioRpcError as e:
            why = f"{e.code().name}: {e.details()}"
        finally:
            link.close()
            call.cancel()  # a no-op once it has ended
            if not self.closing:
                log.warning("%s lost: %s", what, why)
                inbox.lost(link)

    async def health(self) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=5.0, metadata=self.metadata)

    async def close(self) -> None:
        self.closing = True
        for link in self.links:  # end our request streams, then stop reading theirs
            link.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.channel.close()
