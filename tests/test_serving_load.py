"""experiments.serving_load: the latency figures follow vLLM's definitions (TTFT, TPOT, ITL, E2EL), and
a stream's lines are read as the server meant them (an error event mid-stream is a failed request)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from experiments.serving_load import Sample, one_request, one_request_openai, record_line, summarize


def test_figures_follow_vllm_definitions():
    a = Sample(ttft=0.1, chunk_times=[0.1, 0.3, 0.4], e2el=0.5, output_tokens=5)  # chunks of several tokens
    b = Sample(ttft=0.2, chunk_times=[0.2], e2el=0.2, output_tokens=1)  # one token: no TPOT, no ITL
    failed = Sample(error="HTTP 400: bad")
    figures = summarize([a, b, failed], duration_s=2.0)
    assert (figures["requests"], figures["completed"], figures["errors"]) == (3, 2, ["HTTP 400: bad"])
    assert figures["output_tokens"] == 6 and figures["output_tokens_per_s"] == pytest.approx(3.0)
    assert figures["ttft"]["mean_ms"] == pytest.approx(150.0) and figures["ttft"]["median_ms"] == pytest.approx(150.0)
    assert figures["tpot"]["mean_ms"] == pytest.approx(1e3 * (0.5 - 0.1) / 4)  # (E2EL - TTFT) / (tokens - 1)
    assert sorted(a.itl) == pytest.approx([0.1, 0.2])  # gaps between chunks, each counted once
    assert figures["itl"]["mean_ms"] == pytest.approx(150.0) and figures["itl"]["p99_ms"] == pytest.approx(200.0)
    assert figures["e2el"]["median_ms"] == pytest.approx(350.0)


def test_no_successful_request_gives_no_figures():
    figures = summarize([Sample(error="refused")], duration_s=1.0)
    assert figures["completed"] == 0 and figures["ttft"]["median_ms"] is None and figures["output_tokens_per_s"] == 0.0


def chunk(content: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": content}}]}).encode() + b"\n\n"  # one event


def test_a_stream_is_read_line_by_line():
    sample = Sample()
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n'
    for at, line in enumerate([chunk("a"), b"\n", b": keep-alive\n", chunk("bc"), usage, b"data: [DONE]\n"]):
        record_line(sample, line, float(at))
    assert (sample.text, sample.ttft, sample.chunk_times, sample.output_tokens) == ("abc", 0.0, [0.0, 3.0], 3)
    assert sample.done and sample.error is None


def test_an_error_event_mid_stream_is_the_samples_error():
    sample = Sample()
    record_line(sample, chunk("a"), 0.1)
    record_line(sample, b'data: {"error": {"message": "stage \'target\' was lost", "type": "server_error", "code": 500}}\n', 0.2)
    assert sample.error == "error event: stage 'target' was lost" and not sample.done
    assert summarize([sample], duration_s=1.0)["completed"] == 0


FINISH = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
STREAMS = {  # what a server sends, by path: a whole stream, one failing mid-way as ours does, one cut short
    "/ok": [chunk("a"), chunk("b"), FINISH, b"data: [DONE]\n\n"],
    "/failed": [chunk("a"), b'data: {"error": {"message": "stage \'target\' was lost"}}\n\n', b"data: [DONE]\n\n"],
    "/cut": [chunk("a")],
}


@pytest.mark.parametrize("client", ["aiohttp", "openai"])
def test_one_request_fails_on_an_error_event_or_a_stream_without_done(client):
    """The same with raw HTTP and with the official openai client (which consumes [DONE] itself: a stream without a
    finish reason is the cut one)."""
    import openai

    async def scenario() -> dict[str, Sample]:
        async def handler(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for line in STREAMS[request.path.removesuffix("/v1/chat/completions")]:
                await response.write(line)
            await response.write_eof()
            return response

        app = web.Application()
        app.router.add_post("/{base}/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            if client == "openai":
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                samples = {}
                for path in STREAMS:
                    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}{path}/v1", api_key="-", max_retries=0) as c:
                        samples[path] = await one_request_openai(c, body)
                return samples
            async with aiohttp.ClientSession() as session:
                return {path: await one_request(session, f"http://127.0.0.1:{port}{path}", {}) for path in STREAMS}
        finally:
            await runner.cleanup()

    samples = asyncio.run(scenario())
    assert (samples["/ok"].text, samples["/ok"].error) == ("ab", None)
    if client == "openai":
        assert samples["/failed"].error.startswith("APIError: stage 'target' was lost")
        assert samples["/cut"].error == "the stream ended without a finish reason"
    else:
        assert samples["/failed"].error == "error event: stage 'target' was lost"
        assert samples["/cut"].error == "the stream ended without data: [DONE]"
