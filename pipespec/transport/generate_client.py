"""The client side of the coordinator's `Generate` stream: requests out, `Delta`s back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc

from pipespec.generate_args import GenerateArgs
from pipespec.outputs import Delta
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.transport.generate_request import to_proto
from pipespec.transport.generate_response import to_delta
from pipespec.transport.streams import CHANNEL_OPTIONS


def stream(address: str, args: GenerateArgs, timeout: float | None) -> Iterator[Delta]:
    """`args.image`: encoded bytes or None."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = pb_grpc.CoordinatorStub(channel).Generate(to_proto(args), timeout=timeout)
        try:
            for response in call:
                yield to_delta(response)
        except grpc.RpcError as e:
            yield Delta("", (), "error", None, f"the coordinator at {address}: {e.code().name}: {e.details()}")
        finally:
            call.cancel()  # leaving early drops the request on every stage


async def astream(address: str, args: GenerateArgs, timeout: float | None) -> AsyncIterator[Delta]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = pb_grpc.CoordinatorStub(channel).Generate(to_proto(args), timeout=timeout)
        try:
            async for response in call:
                yield to_delta(response)
        except grpc.aio.AioRpcError as e:
            yield Delta("", (), "error", None, f"the coordinator at {address}: {e.code().name}: {e.details()}")
        finally:
            call.cancel()


def health(address: str, timeout: float = 5.0) -> pb.HealthReply:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        return pb_grpc.CoordinatorStub(channel).Health(pb.HealthRequest(), timeout=timeout)
