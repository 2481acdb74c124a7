"""The client side of the coordinator's `Generate` stream: requests out, `Delta`s back.

A `CoordinatorClient` holds one gRPC channel to a coordinator, made on first use and reused by every
call from any thread (gRPC multiplexes them on one connection), and one `grpc.aio` channel per event
loop for `astream` (an aio channel belongs to the loop that made it). `close()` / `aclose()` close
them; a later call opens new ones. A request that ends in an error, and a call that fails (nothing
listens at the address, the connection is lost, the deadline passed), raise `GenerationError` naming
the coordinator's address, after the deltas committed before it; a request the front door refuses
raises `RequestRefused` (a GenerationError and a ValueError) with its message.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator

import grpc

from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.requests.generate_args import GenerateArgs
from pipespec.requests.outputs import Delta, GenerationError, RequestRefused, raise_error
from pipespec.transport.generate_request import to_proto
from pipespec.transport.generate_response import refused, to_delta
from pipespec.transport.streams import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

# a held channel whose coordinator went away tries again within a second of its coming back
OPTIONS = [*CHANNEL_OPTIONS, ("grpc.max_reconnect_backoff_ms", 1000)]


class CoordinatorClient:
    def __init__(self, address: str):
        self.address = address
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._aio: dict[asyncio.AbstractEventLoop, grpc.aio.Channel] = {}

    def _stub(self) -> pb_grpc.CoordinatorStub:
        with self._lock:
            if self._channel is None:
                log.debug("opened a channel to the coordinator at %s", self.address)
                self._channel = grpc.insecure_channel(self.address, options=OPTIONS)
            return pb_grpc.CoordinatorStub(self._channel)

    def _aio_stub(self) -> pb_grpc.CoordinatorStub:
        loop = asyncio.get_running_loop()
        with self._lock:
            for gone in [other for other in self._aio if other.is_closed()]:
                del self._aio[gone]  # its loop is over: dropped, its channel closes itself (see `close`)
            if loop not in self._aio:
                log.debug("opened a channel to the coordinator at %s for event loop %x", self.address, id(loop))
                self._aio[loop] = grpc.aio.insecure_channel(self.address, options=OPTIONS)
            return pb_grpc.CoordinatorStub(self._aio[loop])

    def stream(self, args: GenerateArgs, timeout: float | None) -> Iterator[Delta]:
        """`args`: its image encoded bytes or None. Leaving early cancels the request on every stage."""
        call = self._stub().Generate(to_proto(args), timeout=timeout)
        try:
            for response in call:
                delta = _delta(response)
                yield delta
                if delta.finish_reason is not None:
                    return
        except grpc.RpcError as e:
            raise self._failed(e) from None
        finally:
            call.cancel()
        raise self._unfinished()

    async def astream(self, args: GenerateArgs, timeout: float | None) -> AsyncIterator[Delta]:
        """The async twin of `stream`, on this event loop's channel."""
        call = self._aio_stub().Generate(to_proto(args), timeout=timeout)
        try:
            async for response in call:
                delta = _delta(response)
                yield delta
                if delta.finish_reason is not None:
                    return
        except grpc.aio.AioRpcError as e:
            raise self._failed(e) from None
        finally:
            call.cancel()
        raise self._unfinished()

    def health(self, timeout: float = 5.0) -> pb.HealthReply:
        return self._stub().Health(pb.HealthRequest(), timeout=timeout)

    def close(self) -> None:
        """Close the channel, and each event loop's aio channel: on its loop if that loop runs (in this
        thread or another), else by dropping it. An aio channel's `close()` is a coroutine for its own
        loop, which cannot be awaited once that loop is over; dropped, the channel is collected at once
        (nothing else holds it) and grpc's finalizer (`grpc.aio.Channel.__del__`) destroys its core
        channel, which needs no loop. `_aio_stub` drops those of ended loops the same way."""
        with self._lock:
            channel, self._channel = self._channel, None
            aio, self._aio = self._aio, {}
        if channel is not None:
            channel.close()
        for loop, aio_channel in aio.items():
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(aio_channel.close(), loop)

    async def aclose(self) -> None:
        """Close this event loop's aio channel and wait until it is closed; then `close()` the rest."""
        with self._lock:
            aio_channel = self._aio.pop(asyncio.get_running_loop(), None)
        if aio_channel is not None:
            await aio_channel.close()
        self.close()

    def _failed(self, e: grpc.RpcError) -> GenerationError:
        return GenerationError(f"the coordinator at {self.address}: {e.code().name}: {e.details()}")

    def _unfinished(self) -> GenerationError:
        return GenerationError(f"the coordinator at {self.address} ended the stream without a finish reason")


def _delta(response: pb.GenerateResponse) -> Delta:
    """The response's delta; RequestRefused for the front door's refusal, GenerationError for an error."""
    if refused(response):
        raise RequestRefused(response.error.message)
    return raise_error(to_delta(response))
