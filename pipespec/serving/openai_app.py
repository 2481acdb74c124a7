"""The OpenAI-compatible HTTP API of a served pipeline, as a FastAPI app on the coordinator's event loop.

    app = build_app(serving, allowed_media=None)   # run by uvicorn (pipespec.serving.http_server)

- `POST /v1/chat/completions`: a conversation (system, user and assistant turns, through the target's
  chat template; `image_url` parts as data URLs, or files under `allowed_media`), streamed as
  server-sent events ending with `data: [DONE]`, or answered whole;
- `POST /v1/completions`: a prompt as text (no chat template) or token ids;
- `GET /v1/models`, `GET /health` (200, or 503 naming the stage while `Serving.trouble()`: a lost
  drafter shows here), `GET /metrics` (Prometheus's text format, pipespec.serving.metrics).

A request (pipespec.serving.openai_protocol) is refused with 503 only while `Serving.refusal()` (the
stages not linked, the target lost: a lost drafter costs speed, not service), and with 429 while its
client has `limits.requests_per_client` requests in flight (pipespec.serving.in_flight, each choice
counting). It is admitted through `Serving` once, as its `n` choices, which run concurrently
(pipespec.serving.fan_in); streamed chunks of several choices interleave, each with its `index`.
With `stream_options.include_usage` a last chunk with no choices carries the usage
(pipespec.serving.openai_responses). A client that drops its connection aborts its requests on
every stage: the stream is cancelled (streamed), or the connection is watched (answered whole).
Errors: pipespec.serving.openai_errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipespec.requests.generate_args import GenerateArgs
from pipespec.serving.body_limit import BodyLimit, body_bytes
from pipespec.serving.fan_in import fan_in
from pipespec.serving.in_flight import InFlight
from pipespec.serving.openai_errors import ApiError, bad_value, install_error_handlers
from pipespec.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from pipespec.serving.openai_responses import (
    ChatShape,
    ChoiceTally,
    CompletionShape,
    Head,
    Shape,
    TokenNames,
    envelope,
    usage,
)
from pipespec.serving.serving import Admitted, Serving

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = 499  # what a request whose client left is logged with (nobody reads it)


def build_app(serving: Serving, allowed_media: Path | None = None) -> FastAPI:
    """The app serving `serving`; `allowed_media`: the directory `image_url` file paths may name (None: none)."""
    api = OpenAIApi(serving, allowed_media)
    app = FastAPI(title="pipespec", summary="OpenAI-compatible API of a pipespec pipeline")
    install_error_handlers(app)
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_middleware(BodyLimit, most=body_bytes(serving.front_door.config.limits))
    return app


class OpenAIApi:
    def __init__(self, serving: Serving, allowed_media: Path | None):
        self.serving = serving
        self.allowed_media = allowed_media
        config = serving.front_door.config
        self.names = TokenNames(serving.front_door.tokenizer)
        self.lookahead = {s.name: s.max_lookahead for s in config.stages}
        self.in_flight = InFlight(config.limits.requests_per_client)
        self.created = int(time.time())

    # ---- endpoints --------------------------------------------------------------------------------

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        def args() -> GenerateArgs:  # off the loop (Serving.admit)
            return body.args(self.allowed_media)

        return await self._run(ChatShape(self.names, body.logprobs), body, args, request)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        def args() -> GenerateArgs:  # off the loop (Serving.admit), the prompt's tokenization included
            if isinstance(body.prompt, list):
                return body.args(body.prompt)
            return body.args(self.serving.front_door.plain_text_ids(body.prompt))

        return await self._run(CompletionShape(self.names, body.logprobs is not None), body, args, request)

    async def models(self) -> dict:
        model = {"id": self.serving.model, "object": "model", "created": self.created, "owned_by": "pipespec"}
        return {"object": "list", "data": [{**model, "max_model_len": self.serving.front_door.target.max_context}]}

    async def health(self) -> JSONResponse:
        trouble = self.serving.trouble()
        if trouble is not None:
            return ApiError(503, trouble).response()
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        return Response(self.serving.metrics.exposition(), media_type=self.serving.metrics.content_type)

    # ---- running requests -------------------------------------------------------------------------

    async def _run(self, shape: Shape, body: GenerationRequest, args: Callable[[], GenerateArgs], request: Request) -> Response:
        """Admit `body` (its arguments: `args()`) once, as its `n` choices, held against its client's
        in-flight limit until its answer is done; answer it streamed or whole."""
        if body.model != self.serving.model:
            message = f"model {body.model!r} is not served here; this server serves {self.serving.model!r}"
            raise ApiError(404, message, "model", "model_not_found")
        refusal = self.serving.refusal()
        if refusal is not None:
            raise ApiError(503, f"not ready: {refusal}")
        held = self.in_flight.take(request.client.host if request.client else "", body.n)
        streamed = False
        try:
            try:
                body.check()
                admitted = await self.serving.admit_choices(args, body.seeds())
            except ValueError as e:  # a bad value, named: the front door's refusal
                raise bad_value(str(e), body.renamed, type(body).model_fields) from None
            head = Head(shape.id_prefix + secrets.token_hex(12), int(time.time()), self.serving.model)
            if not body.stream:
                return await self._whole(shape, admitted, head, request)
            events = self._events(shape, admitted, head, body.include_usage, held.release)
            streamed = True  # the events release what is held as they end (the response, if they never start)
            return _Streamed(events, held.release, media_type="text/event-stream", headers=SSE_HEADERS)
        finally:
            if not streamed:
                held.release()

    async def _whole(self, shape: Shape, admitted: list[Admitted], head: Head, request: Request) -> Response:
        """The answer not streamed, once every choice finished (or nothing, once the client left)."""
        tallies = [ChoiceTally(i) for i in range(len(admitted))]
        if not await _unless_disconnected(self._collect(admitted, tallies), request):
            return Response(status_code=CLIENT_GONE)
        failed = next((t for t in tallies if t.finish_reason == "error"), None)
        if failed is not None:
            raise self._failure(failed)
        spent = usage(len(admitted[0].spec.prompt_token_ids), tallies, self.lookahead)
        return JSONResponse(envelope(shape, head, [shape.choice(t) for t in tallies], False, spent))

    async def _collect(self, admitted: list[Admitted], tallies: list[ChoiceTally]) -> None:
        async with contextlib.aclosing(fan_in([self.serving.stream(a) for a in admitted])) as deltas:
            async for i, delta in deltas:
                tallies[i].add(delta)
                if delta.finish_reason == "error":
                    return  # the other choices are aborted

    async def _events(
        self, shape: Shape, admitted: list[Admitted], head: Head, include_usage: bool, done: Callable[[], None]
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed request; cancelled when its client leaves. `done` is
        called as it ends, before the end of the response is sent."""
        try:
            async with contextlib.aclosing(self._chunks(shape, admitted, head, include_usage)) as events:
                async for event in events:
                    yield event
        finally:
            done()

    async def _chunks(self, shape: Shape, admitted: list[Admitted], head: Head, include_usage: bool) -> AsyncIterator[str]:
        tallies = [ChoiceTally(i) for i in range(len(admitted))]
        for i in range(len(admitted)):
            opening = shape.opening(i)
            if opening is not None:
                yield _event(envelope(shape, head, [opening], True))
        async with contextlib.aclosing(fan_in([self.serving.stream(a) for a in admitted])) as deltas:
            async for i, delta in deltas:
                tally = tallies[i]
                offset = tally.chars
                tally.add(delta)
                if delta.finish_reason == "error":
                    yield _event(self._failure(tally).body())
                    yield "data: [DONE]\n\n"
                    return  # the other choices are aborted
                if delta.token_ids or delta.text:  # every token streamed, even where it has no text yet
                    yield _event(envelope(shape, head, [shape.piece(tally, delta, offset)], True))
                if delta.finish_reason is not None:
                    yield _event(envelope(shape, head, [shape.finish(tally)], True))
        if include_usage:
            spent = usage(len(admitted[0].spec.prompt_token_ids), tallies, self.lookahead)
            yield _event(envelope(shape, head, [], True, spent))
        yield "data: [DONE]\n\n"

    def _failure(self, tally: ChoiceTally) -> ApiError:
        """A request that failed in the pipeline: 503 while the pipeline refuses requests (its target
        lost), else 500."""
        status = 503 if self.serving.refusal() is not None else 500
        return ApiError(status, f"the request failed: {tally.error}")


class _Streamed(StreamingResponse):
    """A streamed answer that calls `done` once it ends, however it ends (finished, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], done: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.done = done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.done()


async def _unless_disconnected(work: Awaitable[None], request: Request) -> bool:
    """Run `work` unless the client leaves first (then cancel it: its requests abort); -> whether it ran to its end."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():
            working.cancel()
            await asyncio.gather(working, return_exceptions=True)
    if working.cancelled():
        return False
    working.result()
    return True


async def _disconnected(request: Request) -> None:
    """Returns when the client has dropped its connection (the request's body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False, allow_nan=False)}\n\n"
