"""The pipeline over real gRPC streams (one server per stage on 127.0.0.1) stays exact.

Same stages and runners as in process; only the links differ: every draft, verdict, open, commit
and close crosses a gRPC stream as a msgpack frame. Then the streams themselves: a stream that ends
is reported lost to the endpoint on the other side (never on the side that closed it), a frame the
codec refuses is dropped and the stream goes on, a frame over gRPC's limit ends its stream.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pipespec import LocalPipeline, load_config
from pipespec.config import LimitsSpec
from pipespec.protocol import codec
from pipespec.protocol.messages import Close, Commit, Draft
from pipespec.transport.auth import new_secret
from pipespec.transport.streams import WRAPPER_BYTES, StageClient, StreamLink, channel_options, serve_stage, server_options
from tests.fixtures.recorder import Recorder, next_of


def mocks(agreements, target_ms=0.0, **sampling):
    stages = [
        {"name": f"m{i}", "kind": "mock", "agreement": a, "vocab_size": 64, "max_lookahead": 6} for i, a in enumerate(agreements)
    ]
    stages[-1]["latency_ms"] = target_ms  # a slower target gives drafts time to cross the wire
    return load_config({"stages": stages, "sampling": sampling})


@pytest.fixture(scope="module")
def target_alone():
    with LocalPipeline(mocks([1.0])) as p:
        yield p


@pytest.mark.parametrize("k", [2, 3])
def test_grpc_pipeline_equals_target_alone(k, target_alone):
    requests = [
        dict(prompt_token_ids=[i + 1, 2, 3], max_new_tokens=40, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(10)
    ]
    with LocalPipeline(mocks([0.7] * (k - 1) + [1.0]), over_grpc=True) as p:
        futures = [p.submit(**r) for r in requests]  # all at once: concurrent streams
        got = [f.result(timeout=60) for f in futures]
    for g, r in zip(got, requests):
        assert g.token_ids == target_alone.generate(**r).token_ids
    assert sum(pair.num_accepted_tokens for g in got for pair in g.stats.pairs) > 0


def test_rejection_mode_ships_q_over_grpc():
    with LocalPipeline(mocks([0.3, 1.0], target_ms=3.0, temperature=1.0, verify="rejection"), over_grpc=True) as p:
        outs = [p.generate(prompt_token_ids=[1, 2], max_new_tokens=30, seed=s) for s in range(5)]
    assert all(len(o.token_ids) == 30 and all(0 <= t < 64 for t in o.token_ids) for o in outs)
    assert sum(o.stats.pairs[0].num_draft_tokens for o in outs) > 0


def test_a_stand_drafter_learns_the_commits_relayed_over_grpc(target_alone):
    stand = {"name": "stand", "kind": "stand", "max_lookahead": 6}
    target = {"name": "t", "kind": "mock", "vocab_size": 64, "latency_ms": 2.0}
    request = dict(prompt_token_ids=[5, 2, 3], max_new_tokens=40, temperature=0.0)
    with LocalPipeline(load_config({"stages": [stand, target]}), over_grpc=True) as p:
        first, second = (p.generate(**request) for _ in range(2))
    assert first.token_ids == second.token_ids == target_alone.generate(**request).token_ids
    assert second.stats.pairs[0].token_acceptance > first.stats.pairs[0].token_acceptance + 0.3  # it learnt the answer


def test_real_models_over_grpc_equal_target_alone(family):
    def config(names):
        return load_config({"stages": [{"name": n, "kind": "causal_lm", "model": family[n], "dtype": "float32"} for n in names]})

    with LocalPipeline(config(["target"])) as ref, LocalPipeline(config(["tiny", "mid", "target"]), over_grpc=True) as p:
        for prompt in ([1, 40, 50, 60], [1, 99, 7]):
            assert (
                p.generate(prompt_token_ids=prompt, max_new_tokens=24).token_ids
                == ref.generate(prompt_token_ids=prompt, max_new_tokens=24).token_ids
            )


def test_health_reports_open_requests():
    from pipespec.engine.runner import StageRunner
    from pipespec.stages.build import load_stages

    async def check():
        runner = StageRunner(load_stages(mocks([1.0]))[0], name="m0", depth=0, max_lookahead=0)
        server, port, _ = await serve_stage(runner)
        client = StageClient(f"127.0.0.1:{port}")
        try:
            await client.wait_ready()
            reply = await client.health()
        finally:
            await client.close()
            await server.stop(grace=None)
        return reply

    reply = asyncio.run(check())  # a lone runner: served, but no coordinator stream attached
    assert (reply.name, reply.status, reply.requests) == ("m0", "not_serving: stage 'm0': its coordinator not linked", 0)


# ---- the streams themselves, against a stand-in endpoint (tests.fixtures.recorder) --------------------


def served(scenario, limits=LimitsSpec()):
    """Run `scenario(runner, service, address, secret)` against a stage server on loopback, stopped after."""

    async def run():
        runner, secret = Recorder(), new_secret()
        _, port, service = await serve_stage(runner, secret=secret, limits=limits)
        try:
            return await scenario(runner, service, f"127.0.0.1:{port}", secret)
        finally:
            await service.stop()

    return asyncio.run(run())


def test_a_stream_ended_by_the_client_is_lost_to_the_stage_only():
    async def scenario(runner, service, address, secret):
        inbox, client = Recorder(), StageClient(address, secret=secret)
        link = client.control(inbox)
        role, attached = await next_of(runner.connected)
        link.send(Close("r1"))  # down ...
        attached.send(Commit("r1", 0, (5, 6)))  # ... and up
        got = await next_of(runner.messages), await next_of(inbox.messages)
        await client.close()
        return role, got, await next_of(runner.losses) is attached, inbox.losses.empty()

    assert served(scenario) == ("coordinator", (Close("r1"), Commit("r1", 0, (5, 6))), True, True)


def test_a_stream_ended_by_the_stage_is_lost_to_the_client_only():
    async def scenario(runner, service, address, secret):
        inbox, client = Recorder(), StageClient(address, secret=secret)
        link = client.link(inbox)
        await next_of(runner.connected)
        await service.stop()  # the stage's own shutdown
        try:
            lost = await next_of(inbox.losses)
        finally:
            await client.close()
        queued = link.queue.qsize()
        link.send(Close("r1"))  # a link whose stream is gone drops what is sent
        return lost is link, runner.losses.empty(), link.queue.qsize() - queued

    assert served(scenario) == (True, True, 0)


def test_a_message_the_codec_refuses_is_dropped_and_its_frame_and_stream_go_on(monkeypatch, caplog):
    decode = codec.decode

    def strict(payload, limits=None):
        if payload == b"refused":
            raise codec.FrameError("a frame the codec refuses")
        return decode(payload, limits)

    monkeypatch.setattr(codec, "decode", strict)

    async def scenario(runner, service, address, secret):
        client = StageClient(address, secret=secret)
        try:
            link = client.control(Recorder())
            await next_of(runner.connected)
            link.queue.put_nowait([b"refused", codec.encode(Close("r1"))])  # one frame
            link.send(Close("r2"))
            return await next_of(runner.messages), await next_of(runner.messages), runner.losses.empty()
        finally:
            await client.close()

    assert served(scenario) == (Close("r1"), Close("r2"), True)
    (warning,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert "'stage' coordinator stream" in warning and "a frame the codec refuses" in warning


def test_what_is_queued_while_a_frame_goes_rides_in_the_next_frame_within_the_limit():
    async def frames():
        link = StreamLink(LimitsSpec(frame_bytes=2**20))
        assert link.send_all([Close("r1"), Close("r2")]) == []
        link.send(Close("r0"))
        big = [Draft(rid, 0, 0, (1,), torch.zeros(1, 150_000)) for rid in ("r3", "r4")]  # 600 KB each: not both in a frame
        assert link.send_all(big) == []
        unsent = link.send_all([Close("r5"), Draft("r6", 0, 0, (1,), torch.zeros(1, 300_000)), Draft("r7", 0, 0, (object(),))])
        assert [(m.request_id, type(e).__name__) for m, e in unsent] == [("r6", "FrameError"), ("r7", "TypeError")]
        assert "over the frame limit" in str(unsent[0][1])  # each named, its request to fail; the others went
        link.close()
        return [[codec.decode(p).request_id for p in frame.payloads] async for frame in link.frames()]

    # all queued before the writer ran: in order, cut where the next payload would pass the limit
    assert asyncio.run(frames()) == [["r1", "r2", "r0", "r3"], ["r4", "r5"]]


def test_a_frame_over_the_limit_ends_its_stream_and_frees_the_role():
    async def scenario(runner, service, address, secret):
        client = StageClient(address, secret=secret, limits=LimitsSpec(frame_bytes=2**20))  # a peer with other limits
        try:
            inbox = Recorder()
            link = client.link(inbox)
            _, attached = await next_of(runner.connected)
            link.queue.put_nowait([bytes(256 * 2**10)])  # over 64 KiB and the wrapper's allowance
            lost = await next_of(runner.losses), await next_of(inbox.losses)
            client.link(Recorder())
            await next_of(runner.connected)  # the role is free again
            return lost == (attached, link)
        finally:
            await client.close()

    assert served(scenario, LimitsSpec(frame_bytes=64 * 2**10))


def test_keepalive_follows_the_fault_detection_time():
    client = dict(channel_options(LimitsSpec(frame_bytes=100), detect_s=3.0))
    server = dict(server_options(LimitsSpec(frame_bytes=100), detect_s=3.0))
    assert client["grpc.keepalive_time_ms"] + client["grpc.keepalive_timeout_ms"] == 3000
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert client["grpc.max_receive_message_length"] == server["grpc.max_send_message_length"] == 100 + WRAPPER_BYTES
    assert server["grpc.so_reuseport"] == 0  # a second server on a port in use fails to bind


def test_a_frozen_stage_is_declared_lost_by_keepalive():
    """A stage process stopped dead (SIGSTOP: its socket stays open, nothing answers) is lost to its client
    after about `detect_s`; gRPC alone would wait a minute (the guard below is well under it)."""
    import os
    import signal
    import subprocess
    import sys

    stage = "\n".join(
        [
            "import asyncio",
            "from tests.fixtures.recorder import Recorder",
            "from pipespec.transport.streams import serve_stage",
            "async def main():",
            "    _, port, _ = await serve_stage(Recorder(), secret='s', detect_s=1.0)",
            "    print(port, flush=True)",
            "    await asyncio.Event().wait()",
            "asyncio.run(main())",
        ]
    )
    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", stage], stdout=subprocess.PIPE, text=True, cwd=root)

    async def scenario():
        client = StageClient(f"127.0.0.1:{int(child.stdout.readline())}", secret="s", detect_s=1.0)
        try:
            await client.wait_ready()
            inbox = Recorder()
            link = client.control(inbox)
            await client.health()  # the stream's server answers ...
            os.kill(child.pid, signal.SIGSTOP)  # ... then freezes
            return await next_of(inbox.losses, timeout=20.0) is link
        finally:
            await client.close()

    try:
        assert asyncio.run(scenario())
    finally:
        child.kill()
        child.wait()


def test_each_stream_carries_only_its_own_kinds():
    """An Open on a drafter's stream (a bypass of the front door) or a Commit to a stage is dropped."""

    async def scenario(runner, service, address, secret):
        inbox, client = Recorder(), StageClient(address, secret=secret)
        drafts = client.link(inbox)
        await next_of(runner.connected)
        drafts.send(Close("r1"))  # not a draft: dropped
        drafts.send(Draft("r1", 0, 0, (3,)))
        got = await next_of(runner.messages)
        await client.close()
        return got, runner.messages.empty()

    assert served(scenario) == (Draft("r1", 0, 0, (3,)), True)
