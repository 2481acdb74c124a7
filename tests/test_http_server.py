"""The HTTP server on the pipeline's event loop (pipespec.serving.http_server, LocalPipeline.serve_http),
against three mock stages (no tokenizer, no end of sequence, 20 ms a target step: a request runs as
long as a test needs), served once for the module: it binds loopback only by default, a port in use
is an error naming it, `/health` is 503 until the stages are linked, a client that drops its
connection aborts its request on every stage within a second, a failure in the pipeline ends a stream
with an error event, a bug is a 500 in OpenAI's shape that tells nothing of it but its id, a client
over `limits.requests_per_client` requests in flight gets a 429, and `max_tokens` left out is as
many tokens as the limits and the context allow.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest

import pipespec
from pipespec import LocalPipeline, load_config
from pipespec.requests.frontdoor import FrontDoor
from pipespec.requests.outputs import Delta
from pipespec.serving.body_limit import body_bytes
from pipespec.serving.coordinator import Coordinator
from pipespec.serving.http_server import HttpServer, serve_http
from pipespec.serving.serving import Serving
from tests.fixtures.openai_http import events, get, increase, post, scrape

ABORTED = ("pipespec:request_success_total", (("finished_reason", "abort"),))


@pytest.fixture(scope="module")
def mock():
    """The mock3 pipeline, served by `serve_http()` with its defaults: (pipeline, port)."""
    with LocalPipeline(load_config(Path(pipespec.__file__).parent / "configs" / "mock3.yaml")) as pipe:
        yield pipe, pipe.serve_http()


def start(pipe: LocalPipeline, serving: Serving, port: int = 0) -> HttpServer:
    return asyncio.run_coroutine_threadsafe(serve_http(serving, "127.0.0.1", port), pipe.loop).result()


def stop(pipe: LocalPipeline, server: HttpServer) -> None:
    asyncio.run_coroutine_threadsafe(server.stop(), pipe.loop).result()


def completion(pipe: LocalPipeline, **fields) -> dict:
    return {"model": pipe.serving.model, "prompt": [1, 2, 3], "max_tokens": 8000, **fields}


def test_the_server_binds_loopback_only_by_default(mock):
    _, port = mock
    assert get(port, "/health")[0] == 200
    with pytest.raises(ConnectionRefusedError):  # another loopback address of this machine: not bound
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


def test_a_port_in_use_is_named_and_a_stopped_server_frees_its_port(mock):
    pipe, port = mock
    with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
        start(pipe, pipe.serving, port)
    server = start(pipe, pipe.serving)
    assert get(server.port, "/health")[0] == 200
    stop(pipe, server)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_health_is_503_until_the_stages_are_linked(mock):
    pipe, port = mock
    unlinked = Serving(Coordinator(pipe.coordinator.stage_names, None), pipe.front_door)  # never connected
    server = start(pipe, unlinked)
    try:
        status, body = get(server.port, "/health")
        assert status == 503 and "not linked" in json.loads(body)["error"]["message"]
        status, answer = post(server.port, "/v1/completions", completion(pipe))
        assert status == 503 and answer["error"]["type"] == "service_unavailable_error"
    finally:
        stop(pipe, server)
    assert get(port, "/health") == (200, '{"status":"ok"}')


def send(port: int, body: dict) -> socket.socket:
    """POST `body` to /v1/completions on a raw socket, left open for the caller to read or drop."""
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(head.encode() + data)
    return sock


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.005)


def nothing_open(pipe: LocalPipeline) -> bool:
    return not pipe.coordinator.live and all(not runner.requests for runner in pipe.runners)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_drops_its_connection_aborts_the_request_on_every_stage(mock, stream):
    pipe, port = mock
    before = scrape(port)
    sock = send(port, completion(pipe, stream=stream))
    if stream:
        received = b""
        while b"data: " not in received:  # its first tokens
            received += sock.recv(65536)
    else:
        wait_for(lambda: pipe.coordinator.live, 30, "the request runs")
    assert not nothing_open(pipe)
    sock.close()
    wait_for(lambda: nothing_open(pipe), 1.0, "the request closed on every stage")
    after = scrape(port)
    assert after.get(ABORTED, 0) - before.get(ABORTED, 0) == 1
    assert increase(before, after, "pipespec:num_requests_running") == {(): 0.0}


class FailingServing(Serving):
    """Fails every request in the pipeline after its first tokens, as a stage's failure would."""

    async def stream(self, admitted):
        async for delta in super().stream(admitted):
            yield delta
            yield Delta("", (), "error", None, "stage 'target': it broke")
            return


class BuggyServing(Serving):
    async def admit(self, args):
        raise RuntimeError("a bug")


def test_a_failure_in_the_pipeline_ends_the_stream_with_an_error_and_a_bug_is_a_500(mock):
    pipe, _ = mock
    failing = start(pipe, FailingServing(pipe.coordinator, pipe.front_door))
    buggy = start(pipe, BuggyServing(pipe.coordinator, pipe.front_door))
    broke = {"message": "the request failed: stage 'target': it broke", "type": "server_error", "param": None, "code": None}
    try:
        status, out = post(failing.port, "/v1/completions", completion(pipe, stream=True))
        assert status == 200 and events(out)[-2:] == [{"error": broke}, "[DONE]"]
        assert post(failing.port, "/v1/completions", completion(pipe)) == (500, {"error": broke})
        wait_for(lambda: nothing_open(pipe), 1.0, "the failed requests closed on every stage")
        status, answer = post(buggy.port, "/v1/completions", completion(pipe))
        assert status == 500 and re.fullmatch(
            r"internal error [0-9a-f]{8} \(the server's log has it\)", answer["error"]["message"]
        )
    finally:
        stop(pipe, failing)
        stop(pipe, buggy)


def test_a_body_over_the_limits_is_refused_before_it_is_read(mock):
    """A body over twice the largest request the limits allow is a 413 naming both sizes, whether its
    Content-Length says so or it streams in chunked; a request within them is served by the same server."""
    pipe, _ = mock
    limits = replace(pipe.config.limits, image_bytes=1000, prompt_tokens=64)
    door = FrontDoor(replace(pipe.config, limits=limits), pipe.front_door.target, None)
    server = start(pipe, Serving(pipe.coordinator, door))
    most = body_bytes(limits)
    try:
        status, answer = post(server.port, "/v1/completions", completion(pipe, user="x" * most))
        assert status == 413 and f"over the {most} bytes" in answer["error"]["message"], answer
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        chunks = iter([b'{"prompt": "', *[b"x" * 4096] * (most // 4096 + 2), b'"}'])
        connection.request(
            "POST", "/v1/completions", body=chunks, encode_chunked=True, headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 413 and f"over the {most} bytes" in json.loads(response.read())["error"]["message"]
        connection.close()
        status, answer = post(server.port, "/v1/completions", completion(pipe, max_tokens=4))
        assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    finally:
        stop(pipe, server)


def served_with(pipe: LocalPipeline, target=None, **limits) -> HttpServer:
    """A second server of `pipe`'s coordinator, its front door with these `limits` (and `target`)."""
    config = replace(pipe.config, limits=replace(pipe.config.limits, **limits))
    return start(pipe, Serving(pipe.coordinator, FrontDoor(config, target or pipe.front_door.target, None)))


def test_requests_in_flight_per_client_are_bounded(mock):
    pipe, _ = mock
    server = served_with(pipe, requests_per_client=2)
    try:
        status, answer = post(server.port, "/v1/completions", completion(pipe, n=3, max_tokens=2))
        assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded", answer
        assert "has 0 requests in flight and asks for 3 more: over limits.requests_per_client (2)" in answer["error"]["message"]
        sock = send(server.port, completion(pipe, n=2, stream=True))  # two choices: two requests in flight
        received = b""
        while b"data: " not in received:
            received += sock.recv(65536)
        status, answer = post(server.port, "/v1/completions", completion(pipe, max_tokens=2))
        assert status == 429 and "has 2 requests in flight and asks for 1 more" in answer["error"]["message"]
        sock.close()  # its requests end
        wait_for(lambda: post(server.port, "/v1/completions", completion(pipe, max_tokens=2))[0] == 200, 30, "served again")
        for stream in (False, True):  # a request answered, streamed or whole, holds nothing after
            assert post(server.port, "/v1/completions", completion(pipe, n=2, max_tokens=2, stream=stream))[0] == 200
        assert post(server.port, "/v1/completions", completion(pipe, n=2, max_tokens=2))[0] == 200
    finally:
        stop(pipe, server)


def test_max_tokens_left_out_is_as_many_as_the_limits_and_the_context_allow(mock):
    pipe, _ = mock
    few = served_with(pipe, max_new_tokens=6)
    narrow = served_with(pipe, target=replace(pipe.front_door.target, max_context=5))  # room for 2 after 3
    body = {"model": pipe.serving.model, "prompt": [1, 2, 3]}
    try:
        spent = [post(server.port, "/v1/completions", body)[1]["usage"]["completion_tokens"] for server in (few, narrow)]
        assert spent == [6, 2]
    finally:
        stop(pipe, few)
        stop(pipe, narrow)


def test_a_pipeline_without_a_tokenizer_says_which_request_it_takes(mock):
    """Mock stages have no tokenizer: a chat request is refused naming what works, /v1/completions with token ids."""
    pipe, port = mock
    chat = {"model": pipe.serving.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    status, answer = post(port, "/v1/chat/completions", chat)
    assert status == 400 and answer["error"]["message"] == (
        "this pipeline has no tokenizer (mock stages): pass the prompt of /v1/completions as a list of token ids"
    )
    status, answer = post(port, "/v1/completions", completion(pipe, max_tokens=4))
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
