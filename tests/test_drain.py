"""Draining a server told to stop (pipespec.serving.drain), in process and as `pipespec serve` on SIGTERM / SIGINT.

In process (mock stages, no tokenizer, no end of sequence: a request runs as long as its max tokens):
a drain refuses new requests and readiness, naming the drain, lets running requests finish, and ends
those its grace does not see finished with an error naming `--drain-seconds`.

`pipespec serve` in a process of its own (joining the session's Ray head), with an HTTP stream and a gRPC
stream running when it is signalled: with a long grace both finish as usual while a new request gets HTTP 503 and gRPC
UNAVAILABLE naming the drain; with a short grace the HTTP stream ends with an OpenAI-style error event
and `data: [DONE]`, the gRPC stream with an UNAVAILABLE status; the process exits 0 either way.
Every wait is on the server's output or the streams, never a sleep.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import pipespec
from pipespec import Client, LocalPipeline, load_config
from pipespec.protocol.messages import Close
from pipespec.requests.outputs import GenerationError
from pipespec.serving.drain import DRAINING, begin_drain, drain
from tests.fixtures.openai_http import events, post
from tests.fixtures.ray_head import RayHead

MOCK3 = Path(pipespec.__file__).parent / "configs" / "mock3.yaml"
PROMPT = [1, 2, 3]
PIPESPEC = str(Path(sys.executable).with_name("pipespec"))


# ---- in process ----------------------------------------------------------------------------------


@pytest.fixture
def pipe():
    with LocalPipeline(load_config(MOCK3)) as pipe:
        yield pipe


def on_loop(pipe: LocalPipeline, coroutine) -> asyncio.Future:
    return asyncio.run_coroutine_threadsafe(coroutine, pipe.loop)


async def _begin(pipe: LocalPipeline) -> None:
    begin_drain(pipe.coordinator)


def test_a_drain_refuses_new_requests_and_lets_running_ones_finish(pipe):
    stream = pipe.stream(prompt_token_ids=PROMPT, max_new_tokens=300)
    next(stream)  # running
    on_loop(pipe, _begin(pipe)).result(timeout=10)
    assert pipe.coordinator.live, "the request runs on"
    assert pipe.serving.refusal() == DRAINING and pipe.serving.trouble() == DRAINING
    with pytest.raises(GenerationError, match="the server is shutting down: it finishes the requests it has"):
        pipe.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
    drained = on_loop(pipe, drain(pipe.coordinator, 60.0))
    deltas = list(stream)
    assert deltas[-1].finish_reason == "length" and deltas[-1].stats.generated_tokens == 300
    assert drained.result(timeout=30) == 0


def test_requests_left_when_the_grace_is_over_end_with_an_error_naming_the_drain(pipe):
    stream = pipe.stream(prompt_token_ids=PROMPT, max_new_tokens=8000)
    next(stream)
    assert on_loop(pipe, drain(pipe.coordinator, 0.2)).result(timeout=30) == 1
    with pytest.raises(GenerationError, match=r"shut down before the request finished: .* for 0.2 s \(--drain-seconds\)"):
        list(stream)
    assert not pipe.coordinator.live and all(not runner.requests for runner in pipe.runners)


def test_a_stage_slow_to_close_does_not_keep_the_error_from_its_client(pipe, monkeypatch):
    """A stage that never closes its request (its Close lost) does not keep the request's error from its
    client: the drain completes it without that stage once CLOSE_S is over."""
    monkeypatch.setattr(pipespec.serving.drain, "CLOSE_S", 0.2)
    link, send = pipe.coordinator.stages[0], pipe.coordinator.stages[0].send
    monkeypatch.setattr(link, "send", lambda message: None if isinstance(message, Close) else send(message))
    stream = pipe.stream(prompt_token_ids=PROMPT, max_new_tokens=8000)
    next(stream)
    assert on_loop(pipe, drain(pipe.coordinator, 0.0)).result(timeout=30) == 1
    assert not pipe.coordinator.live  # completed without the first stage's Closed
    with pytest.raises(GenerationError, match=r"shut down before the request finished"):
        list(stream)


# ---- pipespec serve, signalled ---------------------------------------------------------------------


@dataclass
class Served:
    process: subprocess.Popen
    lines: queue.Queue  # the server's output, line by line; None once it ended
    address: str  # gRPC
    http_port: int

    def wait_for(self, text: str, timeout: float = 120.0) -> str:
        """The first line of output holding `text` (earlier lines are skipped)."""
        while True:
            line = self.lines.get(timeout=timeout)
            assert line is not None, f"pipespec serve ended without printing {text!r}"
            if text in line:
                return line


@contextmanager
def serve(tmp_path: Path, drain_s: float, head: RayHead) -> Iterator[Served]:
    """`pipespec serve` of mock3 with a slow target (50 ms a step), gRPC and HTTP on free ports,
    `--drain-seconds drain_s`, joining `head`; killed at the end if still running."""
    config = yaml.safe_load(MOCK3.read_text())
    config["stages"][-1]["latency_ms"] = 50
    config["server"]["port"] = 0
    path = tmp_path / "mock3.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [PIPESPEC, "serve", str(path), "--http-port", "0", "--drain-seconds", str(drain_s)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=head.join())
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        served = Served(process, lines, "", 0)
        served.http_port = int(served.wait_for("OpenAI-compatible HTTP at").rsplit(":", 1)[1])
        served.address = served.wait_for("pipespec: serving").rsplit(" at ", 1)[1].strip()
        yield served
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)


class HttpStream:
    """A streamed completion over HTTP, read event by event."""

    def __init__(self, port: int, max_tokens: int):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"model": "mock3", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
        self.connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        assert self.response.status == 200

    def first_tokens(self) -> None:
        """Returns once the first event came (tokens: mock stages have no text): the request runs."""
        while True:
            line = self.response.readline().decode()
            assert line, "the stream ended before its first tokens"
            if line.startswith("data: "):
                return

    def rest(self) -> list:
        """The events up to the end of the stream."""
        text = self.response.read().decode()
        self.connection.close()
        return events(text)


@contextmanager
def two_streams(served: Served, max_tokens: int) -> Iterator[tuple[HttpStream, Iterator]]:
    """An HTTP and a gRPC stream of `max_tokens`, each running (its first tokens in) when this yields them."""
    streamed = HttpStream(served.http_port, max_tokens=max_tokens)
    streamed.first_tokens()
    with Client(served.address) as client:
        grpc_stream = client.stream(prompt_token_ids=PROMPT, max_new_tokens=max_tokens)
        next(grpc_stream)
        yield streamed, grpc_stream


@pytest.mark.ray
@pytest.mark.slow
def test_sigterm_drains_running_streams_to_their_end_and_refuses_new_requests(tmp_path, ray_head):
    with serve(tmp_path, 120, ray_head) as served:
        with two_streams(served, 600) as (streamed, grpc_stream):
            served.process.send_signal(signal.SIGTERM)
            assert "pipespec: draining (requests running: 2)" in served.wait_for("pipespec: draining")
            status, answer = post(served.http_port, "/v1/completions", {"model": "mock3", "prompt": PROMPT, "max_tokens": 4})
            assert status == 503 and answer["error"]["message"] == f"not ready: {DRAINING}"
            with Client(served.address) as other:
                with pytest.raises(GenerationError, match=f"UNAVAILABLE: {DRAINING}"):
                    other.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
            assert list(grpc_stream)[-1].finish_reason == "length"
        tail = streamed.rest()
        assert tail[-1] == "[DONE]" and tail[-2]["choices"][0]["finish_reason"] == "length"
        assert "pipespec: drained (requests still running then, ended with an error: 0)" in served.wait_for("pipespec: drained")
        assert served.process.wait(timeout=120) == 0


@pytest.mark.ray
@pytest.mark.slow
def test_streams_still_running_when_the_grace_is_over_end_with_an_error_then_done(tmp_path, ray_head):
    with serve(tmp_path, 0.5, ray_head) as served:
        with two_streams(served, 8000) as (streamed, grpc_stream):
            served.process.send_signal(signal.SIGINT)  # Ctrl-C drains as SIGTERM does
            with pytest.raises(GenerationError, match=r"UNAVAILABLE: the server shut down before the request finished"):
                list(grpc_stream)
        tail = streamed.rest()
        assert tail[-1] == "[DONE]"
        assert tail[-2]["error"] == {
            "message": "the request failed: the server shut down before the request finished: it let running requests "
            "finish for 0.5 s (--drain-seconds)",
            "type": "service_unavailable_error",
            "param": None,
            "code": None,
        }
        assert "ended with an error: 2)" in served.wait_for("pipespec: drained")
        assert served.process.wait(timeout=120) == 0


@pytest.mark.ray
@pytest.mark.slow
def test_a_sigterm_as_soon_as_serving_is_printed_stops_it_cleanly(tmp_path, ray_head):
    """The serving line is printed once a stop signal drains: one sent as soon as it is read ends with 0."""
    with serve(tmp_path, 5, ray_head) as served:
        served.process.send_signal(signal.SIGTERM)
        assert "ended with an error: 0)" in served.wait_for("pipespec: drained")
        assert served.process.wait(timeout=120) == 0
