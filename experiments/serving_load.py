"""A load generator for OpenAI-compatible HTTP servers, and its latency figures by vLLM's definitions.

`run_load(url, bodies, concurrency)` sends every body to `POST {url}/v1/chat/completions` as a
streaming request, at most `concurrency` in flight (vLLM's `--max-concurrency`, request rate
unbounded), and times each one from the moment it is sent; `summarize` turns the samples into the
figures `vllm bench serve` prints, with its definitions:

    TTFT  time to first token: send -> the first chunk that carries content
    TPOT  time per output token, per request: (E2EL - TTFT) / (output tokens - 1)  (requests of > 1 token)
    ITL   inter-token latency: every gap between consecutive content chunks, pooled over requests
          (a chunk may carry several tokens: a pipeline commits a block at once, as vLLM's speculative
          decoding does, and the gap is counted once)
    E2EL  end-to-end latency: send -> the stream's end

each as mean, median and p99 (milliseconds), with the output token throughput over the whole run.
Output tokens are the server's `usage.completion_tokens` (the request asks for
`stream_options.include_usage`). A request counts only if its stream ends with `data: [DONE]` and
no error event (`record_line` reads each line). Uses aiohttp, not the server's own client code.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Sample:
    """One request as the client saw it (seconds from its send)."""

    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    e2el: float = 0.0
    output_tokens: int = 0
    text: str = ""
    done: bool = False  # the stream's `data: [DONE]` came
    error: str | None = None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def record_line(sample: Sample, line: bytes, at: float) -> None:
    """Record one line of a streamed chat completion's server-sent events in `sample`, the line having
    arrived `at` seconds after the send: a content chunk's time and text, the usage's token count,
    `data: [DONE]` as `sample.done`, an error event (`data: {"error": {...}}`) as `sample.error`."""
    line = line.strip()
    if not line.startswith(b"data: "):
        return
    if line == b"data: [DONE]":
        sample.done = True
        return
    record_chunk(sample, json.loads(line[6:]), at)


def record_chunk(sample: Sample, chunk: dict, at: float) -> None:
    """Record one chunk of a streamed chat completion (its JSON as a dict), `at` seconds after the send."""
    if (error := chunk.get("error")) is not None:
        sample.error = f"error event: {error.get('message', error) if isinstance(error, dict) else error}"
        return
    if chunk.get("usage"):
        sample.output_tokens = chunk["usage"]["completion_tokens"]
    content = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", []))
    if content:
        sample.ttft = at if sample.ttft is None else sample.ttft
        sample.chunk_times.append(at)
        sample.text += content


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    """Stream one chat completion; a failure is recorded in the sample, never raised: an HTTP error, an
    error event mid-stream (the stream is left there), a stream that ends without `data: [DONE]`."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    sample = Sample()
    sent = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                sample.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return sample
            async for line in response.content:
                record_line(sample, line, time.perf_counter() - sent)
                if sample.error is not None:
                    break
        if sample.error is None and not sample.done:
            sample.error = "the stream ended without data: [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        sample.error = f"{type(e).__name__}: {e}"
    sample.e2el = time.perf_counter() - sent
    return sample


async def one_request_openai(client, body: dict) -> Sample:
    """`one_request` through the official `openai` client (an `AsyncOpenAI`): what our users' code runs. The client
    consumes `data: [DONE]` and raises on an error event; a stream counts as done once a choice's finish reason came."""
    import openai

    sample = Sample()
    sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            record_chunk(sample, chunk.model_dump(exclude_none=True), time.perf_counter() - sent)
            sample.done |= any(choice.finish_reason is not None for choice in chunk.choices)
        if not sample.done:
            sample.error = "the stream ended without a finish reason"
    except openai.APIError as e:
        sample.error = f"{type(e).__name__}: {e}"
    sample.e2el = time.perf_counter() - sent
    return sample


CLIENTS = ("aiohttp", "openai")  # how `run_load` sends: raw HTTP, or the official openai client


async def run_load(
    url: str, bodies: Sequence[dict], concurrency: int, timeout_s: float = 600.0, client: str = "aiohttp"
) -> tuple[list[Sample], float]:
    """Send every body, at most `concurrency` at once, with `client` (one of CLIENTS); -> the samples (in body
    order) and the run's seconds."""
    gate = asyncio.Semaphore(concurrency)
    if client == "openai":
        import openai

        session = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
        send = lambda body: one_request_openai(session, body)  # noqa: E731
    else:
        connector = aiohttp.TCPConnector(limit=concurrency)
        session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))
        send = lambda body: one_request(session, url, body)  # noqa: E731

    async def gated(body: dict) -> Sample:
        async with gate:
            return await send(body)

    try:
        started = time.perf_counter()
        samples = await asyncio.gather(*(gated(b) for b in bodies))
        return list(samples), time.perf_counter() - started
    finally:
        await session.close()


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median and p99 in milliseconds (None when there are no values)."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered) + 0.5) - 1))]  # nearest rank
    return {"mean_ms": 1e3 * statistics.fmean(values), "median_ms": 1e3 * statistics.median(values), "p99_ms": 1e3 * p99}


def summarize(samples: Sequence[Sample], duration_s: float) -> dict:
    """vLLM's serving figures over the samples that succeeded (see the module docstring)."""
    ok = [s for s in samples if s.error is None and s.ttft is not None]
    tokens = sum(s.output_tokens for s in ok)
    return {
        "requests": len(samples),
        "completed": len(ok),
        "errors": [s.error for s in samples if s.error is not None][:5],
        "duration_s": duration_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "ttft": _stats([s.ttft for s in ok]),
        "tpot": _stats([t for s in ok if (t := s.tpot) is not None]),
        "itl": _stats([gap for s in ok for gap in s.itl]),
        "e2el": _stats([s.e2el for s in ok]),
    }
