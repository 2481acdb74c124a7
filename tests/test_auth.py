"""Stage links accept only their own pipeline, one attachment per role (design 5c), over real gRPC.

A hostile local process is a raw gRPC channel to a stage of a live pipeline (three mock stages, every
link a gRPC stream on loopback, a request streaming meanwhile). Without the pipeline's secret, or with
a wrong one, it can neither attach a drafter or coordinator stream, nor inject a frame (a `Close` of
the running request, which would cut it short), nor read one, nor call Health: UNAUTHENTICATED.
With the secret, a second attachment to a role that is live is refused (ALREADY_EXISTS) and never
replaces the live link; the running request finishes equal to the target alone. Once a stream ends,
its role can attach again.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pipespec import LocalPipeline, load_config
from pipespec.protocol import codec
from pipespec.protocol.messages import Close
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.transport.auth import call_metadata, new_secret
from pipespec.transport.streams import StageClient, serve_stage
from tests.fixtures.recorder import Recorder, next_of

VICTIM = dict(prompt_token_ids=[3, 4, 5], max_new_tokens=160, temperature=0.8, seed=3)


def mocks(agreements):
    stages = [
        {"name": f"m{i}", "kind": "mock", "agreement": a, "vocab_size": 64, "max_lookahead": 6} for i, a in enumerate(agreements)
    ]
    stages[-1]["latency_ms"] = 2.0  # the victim stays in flight while it is attacked
    return load_config({"stages": stages})


@pytest.fixture(scope="module")
def pipe():
    with LocalPipeline(mocks([0.7, 0.8, 1.0]), over_grpc=True) as p:
        yield p


@pytest.fixture(scope="module")
def target_alone():
    with LocalPipeline(mocks([1.0])) as p:
        yield p


def call(address: str, method: str, metadata, frames=()) -> tuple[list[pb.Frame], grpc.StatusCode]:
    """A raw stream to the stage at `address`: send `frames`, read all it sends -> (frames read, status)."""
    with grpc.insecure_channel(address) as channel:
        stream = getattr(pb_grpc.StageStub(channel), method)(iter(frames), metadata=metadata, timeout=10)
        received = []
        try:
            for frame in stream:
                received.append(frame)
        except grpc.RpcError as e:
            return received, e.code()
    return received, grpc.StatusCode.OK


def attacked(pipe: LocalPipeline, attack) -> list[int]:
    """Run `attack(victim request id)` while the victim streams; -> the victim's tokens."""
    stream = pipe.stream(**VICTIM)
    first = next(stream)
    (rid,) = pipe._on_loop(lambda: list(pipe.coordinator.live))
    attack(rid)
    return list(first.token_ids) + [t for d in stream for t in d.token_ids]


def links(pipe: LocalPipeline) -> list[tuple]:
    return [(r.upstream, r.coordinator) for r in pipe.runners]


@pytest.mark.parametrize("metadata", [(), call_metadata("not-the-secret")], ids=["no secret", "wrong secret"])
@pytest.mark.parametrize("method, stage", [("Link", 1), ("Link", 2), ("Control", 0), ("Control", 2)])
def test_without_the_secret_nothing_attaches_injects_or_reads(pipe, target_alone, metadata, method, stage):
    before = links(pipe)
    outcomes = []

    def attack(rid):
        inject = pb.Frame(payloads=[codec.encode(Close(rid))])
        outcomes.append(call(pipe.addresses[stage], method, metadata, [inject]))

    ids = attacked(pipe, attack)
    assert outcomes == [([], grpc.StatusCode.UNAUTHENTICATED)]  # nothing read
    assert ids == target_alone.generate(**VICTIM).token_ids  # nothing injected
    assert links(pipe) == before  # nothing attached


@pytest.mark.parametrize("metadata", [(), call_metadata("not-the-secret")], ids=["no secret", "wrong secret"])
def test_health_needs_the_secret(pipe, metadata):
    with grpc.insecure_channel(pipe.addresses[1]) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.StageStub(channel).Health(pb.HealthRequest(), metadata=metadata, timeout=10)
        reply = pb_grpc.StageStub(channel).Health(pb.HealthRequest(), metadata=call_metadata(pipe.secret), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (reply.name, reply.status) == ("m1", "serving")


@pytest.mark.parametrize("method, stage", [("Link", 1), ("Link", 2), ("Control", 0), ("Control", 1), ("Control", 2)])
def test_a_second_attachment_is_refused_and_the_live_request_finishes_exactly(pipe, target_alone, method, stage):
    before = links(pipe)
    outcomes = []

    def attack(rid):
        inject = pb.Frame(payloads=[codec.encode(Close(rid))])
        outcomes.append(call(pipe.addresses[stage], method, call_metadata(pipe.secret), [inject]))

    ids = attacked(pipe, attack)
    assert outcomes == [([], grpc.StatusCode.ALREADY_EXISTS)]
    assert ids == target_alone.generate(**VICTIM).token_ids
    assert links(pipe) == before  # the live links were not replaced


def test_a_stage_whose_drafter_is_not_remote_takes_no_drafter_stream(pipe):
    assert call(pipe.addresses[0], "Link", call_metadata(pipe.secret)) == ([], grpc.StatusCode.FAILED_PRECONDITION)


def test_after_a_stream_ends_its_role_can_attach_again(caplog):
    async def scenario():
        runner, secret = Recorder(), new_secret()
        _, port, service = await serve_stage(runner, secret=secret)
        clients = [StageClient(f"127.0.0.1:{port}", secret=secret) for _ in range(3)]
        try:
            clients[0].link(Recorder())
            first = await next_of(runner.connected)
            refused = Recorder()
            clients[1].link(refused)
            await next_of(refused.losses)  # refused while the first is live
            await clients[0].close()  # the first stream ends...
            assert await next_of(runner.losses) is first[1]
            clients[2].link(Recorder())  # ... and the role is free again
            return first, await next_of(runner.connected)
        finally:
            for client in clients:
                await client.close()
            await service.stop()

    (role, link), (role_again, link_again) = asyncio.run(scenario())
    assert role == role_again == "upstream" and link_again is not link
    assert any("ALREADY_EXISTS" in r.getMessage() for r in caplog.records)
