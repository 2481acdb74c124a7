"""experiments.serving_load: the latency figures follow vLLM's definitions (TTFT, TPOT, ITL, E2EL)."""

from __future__ import annotations

import pytest

from experiments.serving_load import Sample, summarize


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


def test_an_error_event_mid_stream_is_a_failure_not_a_success():
    """A server that ends a stream with an error event: the sample records it (served by a real ASGI app)."""
    import asyncio
    import socket
    import threading

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from experiments.serving_load import one_request

    import aiohttp

    async def events():
        yield 'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
        yield 'data: {"error": {"message": "stage \'target\' failed", "type": "server_error"}}\n\n'
        yield "data: [DONE]\n\n"

    async def chat(request):
        return StreamingResponse(events(), media_type="text/event-stream")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]), port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:

        async def send():
            while not server.started:
                await asyncio.sleep(0.01)  # waits for the server's own readiness flag, not for time
            async with aiohttp.ClientSession() as session:
                return await one_request(session, f"http://127.0.0.1:{port}", {"messages": []})

        sample = asyncio.run(send())
    finally:
        server.should_exit = True
        thread.join()
    assert sample.error == "stream error: stage 'target' failed" and sample.text == "a"
