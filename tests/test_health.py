"""grpc.health.v1 on the coordinator and on every stage, asked with the library's own stub.

NOT_SERVING until the streams are linked, SERVING once they are, NOT_SERVING again once a stage is
lost (a stage's server stopped, as a dead process would end its streams); `Watch` streams each
transition. The stages' health takes the pipeline's secret like their other calls; the coordinator's
is open, like its `Generate`. Every wait is for a message (a watched transition), never a sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipespec import Client, LocalPipeline, load_config
from pipespec.config import PipelineConfig
from pipespec.engine.runner import StageRunner
from pipespec.requests.frontdoor import TargetInfo
from pipespec.serving.coordinator import Coordinator
from pipespec.serving.serving import Serving
from pipespec.stages.build import load_stages
from pipespec.transport.auth import call_metadata, new_secret
from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator
from pipespec.transport.health import COORDINATOR_SERVICE, STAGE_SERVICE
from pipespec.transport.streams import StageClient, StageService
from pipespec.wiring.assembly import Entrance, link_coordinator, link_to_verifier, serve_runner

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SECRET = new_secret()
T = TypeVar("T")


def mocks(n: int) -> PipelineConfig:
    stages = [{"name": f"m{i}", "kind": "mock", "agreement": 0.8, "vocab_size": 64, "max_lookahead": 4} for i in range(n)]
    return load_config({"name": "health", "stages": stages})


@dataclass
class Unlinked:
    """A pipeline whose stages and coordinator serve gRPC but are not linked yet (`link` links them)."""

    config: PipelineConfig
    runners: list[StageRunner]
    services: list[StageService]
    addresses: list[str]
    coordinator: Coordinator
    coordinator_address: str
    clients: list = field(default_factory=list)  # the streams' clients, once linked

    async def link(self) -> None:
        """As the launcher does: each drafter to its verifier, the coordinator to every stage."""
        pairs = zip(self.runners[:-1], self.addresses[1:])
        self.clients += [await link_to_verifier(r, verifier, self.config, SECRET) for r, verifier in pairs]
        self.clients += await link_coordinator(self.coordinator, self.addresses, self.config, SECRET)
        for service in self.services:
            await service.attached()


@asynccontextmanager
async def unlinked(n: int) -> AsyncIterator[Unlinked]:
    config = mocks(n)
    entrance = Entrance.check(config)
    stages = load_stages(config)
    runners = [StageRunner.for_config(stage, config, i) for i, stage in enumerate(stages)]
    served = [await serve_runner(runner, config, SECRET) for runner in runners]
    coordinator = entrance.coordinator()
    serving = Serving(coordinator, entrance.front_door(TargetInfo.of(config.target, stages[-1])))
    server, port = await serve_coordinator(CoordinatorService(serving), "127.0.0.1", 0)
    tasks = [asyncio.create_task(runner.run()) for runner in runners]
    pipe = Unlinked(
        config, runners, [s for _, _, s in served], [f"127.0.0.1:{p}" for _, p, _ in served], coordinator, f"127.0.0.1:{port}"
    )
    try:
        yield pipe
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for service in pipe.services:
            service.stopping = True
        for client in pipe.clients:
            await client.close()
        for service in pipe.services:
            await service.stop()
        await server.stop(grace=None)
        for runner in runners:
            runner.scheduler.shutdown(wait=True)


async def check(address: str, service: str = "", secret: str | None = None) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (
            await stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=call_metadata(secret), timeout=10)
        ).status


async def statuses(pipe: Unlinked) -> list[int]:
    """The coordinator's, then each stage's, overall and by service name."""
    out = [await check(pipe.coordinator_address), await check(pipe.coordinator_address, COORDINATOR_SERVICE)]
    for address in pipe.addresses:
        out += [await check(address, secret=SECRET), await check(address, STAGE_SERVICE, SECRET)]
    return out


async def read(call) -> int:
    """The next status a Watch sends (the timeout only guards against a hang)."""
    return (await asyncio.wait_for(call.read(), 10)).status


def around_linking(stages: int, probe: Callable[[Unlinked], Awaitable[T]]) -> tuple[T, T]:
    """What `probe` finds on an unlinked pipeline of `stages` mock stages, then once it is linked."""

    async def scenario() -> tuple[T, T]:
        async with unlinked(stages) as pipe:
            before = await probe(pipe)
            await pipe.link()
            return before, await probe(pipe)

    return asyncio.run(scenario())


def test_the_coordinator_and_every_stage_serve_once_linked():
    before, after = around_linking(3, statuses)
    assert before == [NOT_SERVING] * 8 and after == [SERVING] * 8


def test_a_stages_pipespec_health_says_what_grpc_health_says():
    """pipespec's own `Health` on a stage answers from the same readiness as grpc.health.v1."""

    async def said(pipe: Unlinked) -> list[tuple[str, int]]:
        clients = [StageClient(address, secret=SECRET) for address in pipe.addresses]
        try:
            return [((await c.health()).status, await check(a, secret=SECRET)) for c, a in zip(clients, pipe.addresses)]
        finally:
            for client in clients:
                await client.close()

    before, after = around_linking(2, said)
    assert before == [
        ("not_serving: stage 'm0': its coordinator and verifier not linked", NOT_SERVING),
        ("not_serving: stage 'm1': its coordinator and drafter not linked", NOT_SERVING),
    ]
    assert after == [("serving", SERVING)] * 2


def test_watch_streams_each_transition():
    """Watched from before linking: NOT_SERVING, SERVING once linked, NOT_SERVING once the target's
    server stops (on the coordinator, and on the drafter whose verifier it was)."""

    async def scenario():
        async with (
            unlinked(2) as pipe,
            grpc.aio.insecure_channel(pipe.coordinator_address) as c,
            grpc.aio.insecure_channel(pipe.addresses[0]) as s,
        ):
            request = health_pb2.HealthCheckRequest(service="")
            coordinator = health_pb2_grpc.HealthStub(c).Watch(request)
            drafter = health_pb2_grpc.HealthStub(s).Watch(
                health_pb2.HealthCheckRequest(service=STAGE_SERVICE), metadata=call_metadata(SECRET)
            )
            seen = [await read(coordinator), await read(drafter)]
            await pipe.link()
            seen += [await read(coordinator), await read(drafter)]
            await pipe.services[1].stop()  # as if its process died: its peers see their streams end
            seen += [await read(coordinator), await read(drafter)]
            coordinator.cancel()
            drafter.cancel()
            return seen, pipe.coordinator.trouble()

    seen, trouble = asyncio.run(scenario())
    assert seen == [NOT_SERVING, NOT_SERVING, SERVING, SERVING, NOT_SERVING, NOT_SERVING]
    assert trouble.startswith("stage 'm1' was lost")


def test_a_stage_server_stopped_in_a_local_pipeline_is_not_serving_on_the_coordinator_and_its_drafter():
    with LocalPipeline(mocks(3), over_grpc=True) as pipe:
        server, port = asyncio.run_coroutine_threadsafe(
            serve_coordinator(CoordinatorService(pipe.serving), "127.0.0.1", 0), pipe.loop
        ).result()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as c, grpc.insecure_channel(pipe.addresses[0]) as s:
                coordinator = health_pb2_grpc.HealthStub(c).Watch(
                    health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE), timeout=30
                )
                drafter = health_pb2_grpc.HealthStub(s).Watch(
                    health_pb2.HealthCheckRequest(), metadata=call_metadata(pipe.secret), timeout=30
                )
                seen = [next(coordinator).status, next(drafter).status]
                assert pipe.generate(prompt_token_ids=[1, 2], max_new_tokens=8).finish_reason == "length"
                asyncio.run_coroutine_threadsafe(pipe._services[1].stop(), pipe.loop).result()
                seen += [next(coordinator).status, next(drafter).status]
                coordinator.cancel()
                drafter.cancel()
                listed = health_pb2_grpc.HealthStub(c).List(health_pb2.HealthListRequest(), timeout=10).statuses
            said = Client(f"127.0.0.1:{port}").health()  # pipespec's own Health, from the same readiness
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(grace=None), pipe.loop).result()
    assert seen == [SERVING, SERVING, NOT_SERVING, NOT_SERVING]
    assert {name: s.status for name, s in listed.items()} == {"": NOT_SERVING, COORDINATOR_SERVICE: NOT_SERVING}
    assert said.startswith("not_serving: stage 'm1' was lost")


def test_a_stages_health_takes_the_secret_and_knows_its_names():
    async def scenario():
        async with unlinked(2) as pipe:
            await pipe.link()
            refused = []
            for secret in (None, "not-the-secret"):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await check(pipe.addresses[1], secret=secret)
                refused.append(e.value.code())
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await check(pipe.addresses[1], COORDINATOR_SERVICE, SECRET)
            with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
                await check(pipe.coordinator_address, STAGE_SERVICE)
            return refused, unknown.value.code(), elsewhere.value.code(), await check(pipe.coordinator_address)

    refused, unknown, elsewhere, open_to_all = asyncio.run(scenario())
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert unknown == elsewhere == grpc.StatusCode.NOT_FOUND
    assert open_to_all == SERVING
