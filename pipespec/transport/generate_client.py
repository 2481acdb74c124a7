"""The client side of the coordinator's `Generate` stream: requests out, `Delta`s back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from pipespec import codec
from pipespec.outputs import Delta
from pipespec.transport.streams import CHANNEL_OPTIONS
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc


def build_request(
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    image: bytes | None,
    max_new_tokens: int,
    sampling: dict[str, Any],
    stop: list[str] | None,
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        prompt=prompt or "",
        prompt_token_ids=prompt_token_ids or [],
        image=image or b"",
        max_new_tokens=max_new_tokens,
        stop=stop or [],
    )
    for name, value in sampling.items():
        if value is not None:
            setattr(request, name, value)
    return request


def to_delta(response: pb.GenerateResponse) -> Delta:
    kind = response.WhichOneof("kind")
    if kind == "chunk":
        return Delta(response.chunk.text, tuple(response.chunk.token_ids))
    if kind == "finished":
        return Delta("", (), response.finished.finish_reason, codec.decode(response.finished.stats))
    return Delta("", (), "error", None, response.error.message)


def stream(address: str, request: pb.GenerateRequest, timeout: float | None) -> Iterator[Delta]:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = pb_grpc.CoordinatorStub(channel).Generate(request, timeout=timeout)
        try:
            for response in call:
                yield to_delta(response)
        except grpc.RpcError as e:
            yield Delta("", (), "error", None, f"{address}: {e.code().name}: {e.details()}")
        finally:
            call.cancel()  # leaving early drops the request on every stage


async def astream(address: str, request: pb.GenerateRequest, timeout: float | None) -> AsyncIterator[Delta]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = pb_grpc.CoordinatorStub(channel).Generate(request, timeout=timeout)
        try:
            async for response in call:
                yield to_delta(response)
        except grpc.aio.AioRpcError as e:
            yield Delta("", (), "error", None, f"{address}: {e.code().name}: {e.details()}")
        finally:
            call.cancel()


def health(address: str, timeout: float = 5.0) -> pb.HealthReply:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        return pb_grpc.CoordinatorStub(channel).Health(pb.HealthRequest(), timeout=timeout)
