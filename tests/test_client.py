"""Tests for pipespec/client.py (and its gRPC side, pipespec/transport/generate_client.py).

A `Client` holds one channel: many requests, from several threads, cross one connection, counted
on the server side by `context.peer()`; `close()` and `with` close it; `astream` holds one per event
loop. `stream` yields what was committed and then raises the same `GenerationError` as `generate`:
a request that fails mid-stream, one refused by the Client's own checks (nothing is sent), and an
address where nothing listens (naming it). A refusal, the Client's or the server's front door's, is
a `RequestRefused`: a ValueError too, as `LocalPipeline`'s is. A message's image part is sent as encoded bytes.
`max_new_tokens` means the same on every way in (None, unset on the wire, `max_tokens` left out: as
many as the limits allow; the keyword left out: 64) and a bad one is refused with one message on each:
LocalPipeline, the Client, the raw wire, HTTP and `pipespec generate`.

The server: a small mock pipeline (`LocalPipeline`) behind the coordinator's gRPC service on
127.0.0.1, the service recording each `Generate`'s connection and request.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import re
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import pytest
from PIL import Image

from pipespec import Client, GenerationError, LocalPipeline, RequestRefused, load_config
from pipespec.cli import main as cli
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.requests.chat import IMAGE, ChatMessage, Part
from pipespec.requests.generate_args import DEFAULT_MAX_NEW_TOKENS
from pipespec.requests.images import image_bytes
from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator
from pipespec.transport.generate_request import from_proto
from tests.fixtures.faults import kill_stage
from tests.fixtures.openai_http import post
from tests.fixtures.ports import nowhere

REQUESTS = [dict(prompt_token_ids=[5, 9, 1 + i], max_new_tokens=6) for i in range(12)]


class Recorded(CoordinatorService):
    """The coordinator's service, recording the connection (`context.peer()`) and request of each `Generate`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.peers: list[str] = []
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.peers.append(context.peer())
        self.requests.append(request)
        async for response in super().Generate(request, context):
            yield response


@dataclass
class Served:
    pipe: LocalPipeline
    service: Recorded
    address: str

    def connections(self) -> int:
        return len(set(self.service.peers))


def mock2(restore_s: float = 30.0):
    stage = {"kind": "mock", "vocab_size": 64, "max_lookahead": 4}
    stages = [{"name": "drafter", "agreement": 0.7, **stage}, {"name": "target", **stage}]
    return load_config({"stages": stages, "faults": {"restore_s": restore_s}})


@contextmanager
def serve(pipe: LocalPipeline) -> Iterator[Served]:
    service = Recorded(pipe.serving, "client-test")
    server, port = asyncio.run_coroutine_threadsafe(serve_coordinator(service, "127.0.0.1", 0), pipe.loop).result()
    try:
        yield Served(pipe, service, f"127.0.0.1:{port}")
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), pipe.loop).result()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with LocalPipeline(mock2()) as pipe, serve(pipe) as served:
        yield served


@pytest.fixture(scope="module")
def expected(served) -> list[list[int]]:
    return [served.pipe.generate(**r).token_ids for r in REQUESTS]


@pytest.fixture
def channels(monkeypatch) -> dict[str, list]:
    """The gRPC channels made while a test runs, sync and aio."""
    made: dict[str, list] = {"sync": [], "aio": []}

    def recording(factory, kind):
        def make(*args, **kwargs):
            made[kind].append(factory(*args, **kwargs))
            return made[kind][-1]

        return make

    monkeypatch.setattr(grpc, "insecure_channel", recording(grpc.insecure_channel, "sync"))
    monkeypatch.setattr(grpc.aio, "insecure_channel", recording(grpc.aio.insecure_channel, "aio"))
    return made


def is_closed(channel: grpc.Channel) -> bool:
    try:
        pb_grpc.CoordinatorStub(channel).Health(pb.HealthRequest(), timeout=10)
    except ValueError:  # "Cannot invoke RPC on closed channel!"
        return True
    return False


async def is_closed_aio(channel: grpc.aio.Channel) -> bool:
    try:
        await pb_grpc.CoordinatorStub(channel).Health(pb.HealthRequest(), timeout=10)
    except grpc.aio.UsageError:  # "Channel is closed."
        return True
    return False


def test_one_client_holds_one_connection_until_closed(served, expected, channels):
    served.service.peers.clear()
    client = Client(served.address)
    assert [client.generate(**r).token_ids for r in REQUESTS] == expected
    with ThreadPoolExecutor(4) as pool:  # from several threads at once too
        assert list(pool.map(lambda r: client.generate(**r).token_ids, REQUESTS)) == expected
    assert client.health() == "serving"
    assert len(served.service.peers) == 2 * len(REQUESTS) and served.connections() == 1
    assert len(channels["sync"]) == 1
    client.close()
    assert is_closed(channels["sync"][0])
    assert client.generate(**REQUESTS[0]).token_ids == expected[0]  # on a new channel
    client.close()
    with Client(served.address) as other:
        assert [other.generate(**r).token_ids for r in REQUESTS[:3]] == expected[:3]
    assert len(channels["sync"]) == 3 and all(is_closed(c) for c in channels["sync"])


def test_astream_holds_one_connection_per_event_loop(served, expected, channels):
    served.service.peers.clear()
    client = Client(served.address)

    async def answers() -> list[list[int]]:
        async def one(request: dict) -> list[int]:
            return [t async for d in client.astream(**request) for t in d.token_ids]

        sequential = [await one(r) for r in REQUESTS[:4]]
        return sequential + list(await asyncio.gather(*(one(r) for r in REQUESTS[4:])))

    async def answers_then_close() -> tuple[list[list[int]], bool]:
        async with client:
            got = await answers()
        return got, await is_closed_aio(channels["aio"][-1])

    assert asyncio.run(answers()) == expected
    assert len(channels["aio"]) == 1 and served.connections() == 1
    assert asyncio.run(answers_then_close()) == (expected, True)  # another loop: its own channel, closed on leaving
    assert len(channels["aio"]) == 2
    assert channels["sync"] == []


def test_a_channel_whose_event_loop_ended_is_closed_once_another_loop_asks(served, expected, monkeypatch):
    """Its loop is gone, so `close()` cannot be awaited on it: dropped, the channel closes itself (grpc's finalizer)."""
    made: list[tuple[weakref.ref, object]] = []  # each aio channel, weakly, and its core channel (grpc's, private)
    real = grpc.aio.insecure_channel

    def recording(*args, **kwargs):
        channel = real(*args, **kwargs)
        made.append((weakref.ref(channel), channel._channel))
        return channel

    monkeypatch.setattr(grpc.aio, "insecure_channel", recording)
    client = Client(served.address)

    async def answer() -> list[int]:
        return [t async for d in client.astream(**REQUESTS[0]) for t in d.token_ids]

    assert asyncio.run(answer()) == expected[0]
    assert made[0][0]() is not None and not made[0][1].closed()  # held while no other loop asks
    assert asyncio.run(answer()) == expected[0]  # another loop: the ended one's channel is dropped
    gc.collect()  # (none is needed today: nothing else holds it)
    assert made[0][0]() is None and made[0][1].closed()
    assert made[1][0]() is not None and not made[1][1].closed()
    client.close()


def test_a_failure_mid_stream_raises_after_the_committed_deltas():
    with LocalPipeline(mock2(restore_s=0.2)) as pipe, serve(pipe) as served:
        with Client(served.address) as client:
            stream = client.stream(prompt_token_ids=[3, 5, 7], max_new_tokens=48)
            first = next(d for d in stream if d.token_ids)
            kill_stage(pipe, 1)
            why = "stage 'target' was lost and not restored within 0.2 s"
            with pytest.raises(GenerationError, match=why):
                list(stream)
            assert first.token_ids
            with pytest.raises(GenerationError, match="stage 'target' was lost") as refused:
                client.generate(prompt_token_ids=[3, 5, 7], max_new_tokens=4)
            with pytest.raises(GenerationError) as streamed:
                list(client.stream(prompt_token_ids=[3, 5, 7], max_new_tokens=4))
            assert str(streamed.value) == str(refused.value)


def test_nothing_listening_raises_naming_the_address():
    address = nowhere()
    deltas = []
    with Client(address) as client:
        with pytest.raises(GenerationError, match=re.escape(f"the coordinator at {address}: UNAVAILABLE")):
            deltas.extend(client.stream(prompt_token_ids=[1, 2], max_new_tokens=4))
        with pytest.raises(GenerationError, match=re.escape(address)):
            client.generate(prompt_token_ids=[1, 2], max_new_tokens=4)

        async def astream() -> None:
            async with client:
                deltas.extend([d async for d in client.astream(prompt_token_ids=[1, 2], max_new_tokens=4)])

        with pytest.raises(GenerationError, match=re.escape(f"the coordinator at {address}: UNAVAILABLE")):
            asyncio.run(astream())
    assert deltas == []


def test_a_value_the_client_refuses_raises_before_anything_is_sent(served):
    sent = len(served.service.requests)
    with Client(served.address) as client:
        with pytest.raises(GenerationError, match=re.escape("temperature must be >= 0, got -1.0")):
            list(client.stream(prompt_token_ids=[1, 2], temperature=-1.0))

        async def astream() -> None:
            [d async for d in client.astream(prompt_token_ids=[1, 2], max_new_tokens=0)]

        with pytest.raises(GenerationError, match="max_new_tokens must be a positive integer, got 0"):
            asyncio.run(astream())
        with pytest.raises(ValueError, match="top_p"):  # a refusal is a ValueError too, as LocalPipeline's is
            client.generate(prompt_token_ids=[1, 2], top_p=2.0)
    assert len(served.service.requests) == sent


def test_a_refusal_is_a_value_error_as_in_process_and_a_failure_is_not(served):
    """RequestRefused, a GenerationError and a ValueError, for what the Client or the server's front door
    refuses, with `LocalPipeline`'s message; a coordinator that cannot be reached is no refusal."""
    over = dict(prompt_token_ids=[1, 2], max_new_tokens=9000)  # over limits.max_new_tokens: the front door's to see
    with Client(served.address) as client:
        with pytest.raises(ValueError, match=re.escape("temperature must be >= 0, got -1.0")) as here:
            client.generate(prompt_token_ids=[1, 2], temperature=-1.0)
        with pytest.raises(ValueError) as there:
            list(client.stream(**over))

        async def astream() -> None:
            [d async for d in client.astream(**over)]

        with pytest.raises(ValueError) as there_async:
            asyncio.run(astream())
    with pytest.raises(ValueError) as in_process:
        served.pipe.generate(**over)
    with Client(nowhere()) as client, pytest.raises(GenerationError) as unreachable:
        client.generate(prompt_token_ids=[1, 2], max_new_tokens=4)
    assert all(type(e.value) is RequestRefused for e in (here, there, there_async))
    why = "max_new_tokens 9000 is over limits.max_new_tokens (8192)"
    assert str(there.value) == str(there_async.value) == str(in_process.value) == why
    assert not isinstance(unreachable.value, RequestRefused)


def test_an_image_in_a_message_part_is_sent_as_encoded_bytes(served, tmp_path):
    picture = Image.new("RGB", (12, 9), (200, 30, 40))
    png, _ = image_bytes(picture)
    path = tmp_path / "picture.png"
    path.write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    parts = {
        "a path": {"type": "image_url", "image_url": {"url": str(path)}},
        "a data URL": {"type": "image_url", "image_url": {"url": url}},
        "a PIL image": {"type": "image", "image": picture},
    }
    with Client(served.address) as client:
        for what, part in parts.items():
            messages = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [part, {"type": "text", "text": "What colour is it?"}]},
            ]
            with pytest.raises(GenerationError, match="does not take images"):  # the mock target's front door
                client.generate(messages=messages, max_new_tokens=4)
            args = from_proto(served.service.requests[-1])
            assert Image.open(io.BytesIO(args.image)).tobytes() == picture.tobytes(), what
            assert args.messages == (
                ChatMessage("system", (Part("Be brief."),)),
                ChatMessage("user", (IMAGE, Part("What colour is it?"))),
            )


# ---- max_new_tokens: one meaning, one message, on every way in ---------------------------------------

MOST = 80  # `limited`'s limits.max_new_tokens; the mock target has no context limit and no end of sequence
IDS = [5, 9, 2]


@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[Served, int]]:
    """mock2 with limits.max_new_tokens = MOST, served over gRPC and HTTP: (served, HTTP port)."""
    stage = {"kind": "mock", "vocab_size": 64, "max_lookahead": 4}
    stages = [{"name": "drafter", "agreement": 0.7, **stage}, {"name": "target", **stage}]
    with LocalPipeline(load_config({"stages": stages, "limits": {"max_new_tokens": MOST}})) as pipe, serve(pipe) as served:
        yield served, pipe.serve_http()


def raw_generate(address: str, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """`request` sent as it is, no client-side check."""
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.CoordinatorStub(channel).Generate(request, timeout=60))


def test_max_new_tokens_means_the_same_on_every_way_in(limited, capsys):
    """None (LocalPipeline, the Client), unset on the wire, `max_tokens` left out or null over HTTP: as
    many as the pipeline's limits allow (MOST here). The Python API's keyword left out, and `pipespec
    generate` without `--max-new-tokens`: DEFAULT_MAX_NEW_TOKENS, sent as a number."""
    served, port = limited
    pipe, recorded = served.pipe, served.service.requests
    assert len(pipe.generate(prompt_token_ids=IDS, max_new_tokens=None).token_ids) == MOST
    assert len(pipe.generate(prompt_token_ids=IDS).token_ids) == DEFAULT_MAX_NEW_TOKENS
    with Client(served.address) as client:
        assert len(client.generate(prompt_token_ids=IDS, max_new_tokens=None).token_ids) == MOST
        assert not recorded[-1].HasField("max_new_tokens")  # None crosses as unset

        async def astream() -> list[int]:
            return [t async for d in client.astream(prompt_token_ids=IDS, max_new_tokens=None) for t in d.token_ids]

        assert len(asyncio.run(astream())) == MOST
        assert len(client.generate(prompt_token_ids=IDS).token_ids) == DEFAULT_MAX_NEW_TOKENS
        assert recorded[-1].max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    responses = raw_generate(served.address, pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS)))
    assert sum(len(r.chunk.token_ids) for r in responses) == MOST  # unset on the wire
    assert responses[-1].finished.stats.generated_tokens == MOST
    for absent in ({}, {"max_tokens": None}):
        status, answer = post(port, "/v1/completions", {"model": pipe.serving.model, "prompt": IDS, **absent})
        assert status == 200 and answer["usage"]["completion_tokens"] == MOST, absent
    sent = len(recorded)
    assert cli(["generate", "--address", served.address, "--prompt", "hi"]) == 2  # the mock has no tokenizer: bad input
    assert "no tokenizer" in capsys.readouterr().err
    assert len(recorded) == sent + 1 and recorded[-1].max_new_tokens == DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize(
    "value, message",
    [
        (0, "max_new_tokens must be a positive integer, got 0"),
        (-5, "max_new_tokens must be a positive integer, got -5"),
        (2**63, "max_new_tokens must be a positive integer below 2**63, got 9223372036854775808"),
        (MOST + 1, f"max_new_tokens {MOST + 1} is over limits.max_new_tokens ({MOST})"),
    ],
    ids=["0", "negative", "beyond int64", "over the limit"],
)
def test_a_bad_max_new_tokens_is_refused_with_one_message_on_every_way_in(limited, value, message, capsys):
    """LocalPipeline, the Client (before anything is sent, but for a limit: the server's), the raw wire,
    HTTP (naming `max_tokens`) and `pipespec generate` (exit 2, before anything is sent but for a limit)."""
    served, port = limited
    pipe, recorded = served.pipe, served.service.requests
    limit = value == MOST + 1  # only the pipeline knows it
    with pytest.raises(ValueError) as in_process:
        pipe.generate(prompt_token_ids=IDS, max_new_tokens=value)
    assert str(in_process.value) == message
    sent = len(recorded)
    with Client(served.address) as client, pytest.raises(RequestRefused) as by_client:
        ask = client.generate if limit else client.stream  # a bad value: refused by the call itself, nothing iterated
        ask(prompt_token_ids=IDS, max_new_tokens=value)
    assert str(by_client.value) == message and len(recorded) == sent + limit
    if value < 2**63:  # what the wire can carry
        responses = raw_generate(served.address, pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS), max_new_tokens=value))
        assert [r.WhichOneof("kind") for r in responses] == ["error"] and responses[0].error.message == message
    status, answer = post(port, "/v1/completions", {"model": pipe.serving.model, "prompt": IDS, "max_tokens": value})
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert answer["error"]["message"] == re.sub("^max_new_tokens", "max_tokens", message)
    sent = len(recorded)
    assert cli(["generate", "--address", served.address, "--prompt", "hi", "--max-new-tokens", str(value)]) == 2  # bad input
    assert capsys.readouterr().err == f"pipespec generate: {message}\n"
    assert len(recorded) == sent + limit  # refused before anything is sent, unless only the server can see it
