"""The coordinator's gRPC service around its coordinator: requests in flight per client connection
are bounded, request ids cannot be guessed, `Cancel` obeys only the connection that opened the
request or the pipeline's secret, and `Health` says why the pipeline is not serving.

The service is served on 127.0.0.1 around a stand-in coordinator whose requests stay in flight until
released, so what is in flight when is decided by the test, not by timing. A connection of its own
is a channel with its own subchannel pool: channels alike share one connection (gRPC's global pool).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import pytest

from pipespec import Client, GenerationError, load_config
from pipespec.protocol.messages import RequestSpec
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.requests.frontdoor import FrontDoor, TargetInfo, new_request_id
from pipespec.requests.generate_args import GenerateArgs
from pipespec.requests.outputs import Delta
from pipespec.serving.serving import Serving
from pipespec.transport.auth import call_metadata, new_secret
from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator
from pipespec.transport.generate_request import to_proto

SECRET = new_secret()
REQUEST = to_proto(GenerateArgs(prompt_token_ids=(1, 2), max_new_tokens=4))


class HeldCoordinator:
    """Stands in for the coordinator: each request sends one chunk, then stays in flight until
    released or aborted."""

    def __init__(self) -> None:
        self.stage_names = ["m"]
        self.stages = ["m"]  # linked
        self.live: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.reason: str | None = None
        self.draining: str | None = None  # never drains

    def trouble(self) -> str | None:
        return self.reason

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.live[request_id].set()

    def release(self) -> None:
        for done in self.live.values():
            done.set()

    async def generate(self, spec: RequestSpec, stop: tuple[str, ...]) -> AsyncIterator[Delta]:
        done = self.live[spec.request_id] = asyncio.Event()
        try:
            yield Delta("a", (1,))
            await done.wait()
            yield Delta("", (), "abort" if spec.request_id in self.aborted else "length")
        finally:
            del self.live[spec.request_id]


@dataclass
class Served:
    address: str
    coordinator: HeldCoordinator
    loop: asyncio.AbstractEventLoop

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.coordinator.release)

    def connection(self) -> grpc.Channel:
        """A channel on a connection of its own."""
        return grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, loop).result()  # noqa: E731
    config = load_config({"stages": [{"name": "m", "kind": "mock", "vocab_size": 16}], "limits": {"requests_per_client": 2}})
    coordinator = HeldCoordinator()
    door = FrontDoor(config, TargetInfo("m", "mock", 16, None, frozenset()), None)
    server, port = run(serve_coordinator(CoordinatorService(Serving(coordinator, door), "held", secret=SECRET), "127.0.0.1", 0))
    try:
        yield Served(f"127.0.0.1:{port}", coordinator, loop)
    finally:
        loop.call_soon_threadsafe(coordinator.release)
        run(server.stop(grace=None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_requests_in_flight_per_connection_are_bounded(served):
    client = Client(served.address)
    first, second = client.stream(prompt_token_ids=[1]), client.stream(prompt_token_ids=[2])
    assert next(first).token_ids == next(second).token_ids == (1,)  # both in flight on this process's connection
    with pytest.raises(GenerationError) as refused:
        list(client.stream(prompt_token_ids=[3]))
    assert "RESOURCE_EXHAUSTED" in str(refused.value) and "limits.requests_per_client (2)" in str(refused.value)
    with served.connection() as other:  # another connection has its own count
        elsewhere = pb_grpc.CoordinatorStub(other).Generate(REQUEST, timeout=30)
        assert next(elsewhere).WhichOneof("kind") == "chunk"
        served.release()
        assert [d.finish_reason for d in first] == [d.finish_reason for d in second] == ["length"]
        assert next(elsewhere).finished.finish_reason == "length"
    again = client.stream(prompt_token_ids=[4])  # the two finished: room again
    assert next(again).token_ids == (1,)
    served.release()
    assert [d.finish_reason for d in again] == ["length"]


def test_request_ids_are_unguessable(served):
    with grpc.insecure_channel(served.address) as channel:
        calls = [pb_grpc.CoordinatorStub(channel).Generate(REQUEST, timeout=30) for _ in range(2)]
        ids = [next(call).request_id for call in calls]
        served.release()
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]
    assert len({new_request_id() for _ in range(1000)}) == 1000


def test_only_the_opener_or_the_secret_may_cancel(served):
    held = served.coordinator
    with grpc.insecure_channel(served.address) as owner, served.connection() as stranger:
        opened = [pb_grpc.CoordinatorStub(owner).Generate(REQUEST, timeout=30) for _ in range(2)]
        first, second = (next(call).request_id for call in opened)

        def cancel(channel: grpc.Channel, request_id: str, secret: str | None = None) -> bool:
            reply = pb_grpc.CoordinatorStub(channel).Cancel(
                pb.CancelRequest(request_id=request_id), metadata=call_metadata(secret)
            )
            return reply.cancelled

        assert not cancel(stranger, first)
        assert not cancel(stranger, first, secret="not-the-secret")
        assert not cancel(stranger, "req-" + "0" * 32) and not cancel(owner, "req-" + "0" * 32)  # a guessed id
        assert held.aborted == [] and set(held.live) == {first, second}
        assert cancel(owner, first)
        assert cancel(stranger, second, secret=SECRET)
        assert held.aborted == [first, second]
        assert [[r.finished.finish_reason for r in call] for call in opened] == [["abort"], ["abort"]]  # to their ends
        assert not cancel(owner, first)  # over: nothing left to cancel


def test_health_says_why_it_is_not_serving(served):
    client = Client(served.address)
    assert client.health() == "serving"
    served.coordinator.reason = "stage 'm' lost"
    assert client.health() == "not_serving: stage 'm' lost"
