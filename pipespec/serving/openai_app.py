"""The OpenAI-compatible HTTP API of a served pipeline, as a FastAPI app on the coordinator's event loop.

    app = build_app(serving, allowed_media=None)   # run by uvicorn (pipespec.serving.http_server)

- `POST /v1/chat/completions`: a conversation (system, user and assistant turns, through the target's
  chat template; `image_url` parts as data URLs, or files under `allowed_media`), streamed as
  server-sent events ending with `data: [DONE]`, or answered whole;
- `POST /v1/completions`: a prompt as text (no chat template) or token ids;
- `GET /v1/models`, `GET /health` (200, or 503 with the reason while `Serving.trouble()`),
  `GET /metrics` (Prometheus's text format, pipespec.serving.metrics).

Requests (pipespec.serving.openai_protocol) are admitted through `Serving`, one request per choice
(`n`), and run concurrently (pipespec.serving.fan_in); streamed chunks of several choices interleave,
each with its `index`. With `stream_options.include_usage` a last chunk with no choices carries the
usage (pipespec.serving.openai_responses). A client that drops its connection aborts its requests on
every stage: the stream is cancelled (streamed), or the connection is watched (answered whole).
Errors: pipespec.serving.openai_errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipespec.generate_args import GenerateArgs
from pipespec.serving.body_limit import BodyLimit, body_bytes
from pipespec.serving.fan_in import fan_in
from pipespec.serving.openai_errors import ApiError, install_error_handlers
from pipespec.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from pipespec.serving.openai_responses import ChatShape, ChoiceTally, CompletionShape, Shape, TokenNames, envelope, usage
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
        self.default_seed = config.sampling.seed
        self.created = int(time.time())

    # ---- endpoints --------------------------------------------------------------------------------

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._ready(body)
        with _bad_value_is_400():
            body.check()
            args = [body.choice_args(i, self.allowed_media, self.default_seed) for i in range(body.n)]
        return await self._run(ChatShape(self.names, body.logprobs), args, body, request)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._ready(body)
        with _bad_value_is_400():
            body.check()
            ids = await asyncio.to_thread(body.prompt_ids, self.serving.front_door)  # a long text: off the loop
        args = [body.choice_args(i, ids, self.default_seed) for i in range(body.n)]
        return await self._run(CompletionShape(self.names, body.logprobs is not None), args, body, request)

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

    def _ready(self, body: GenerationRequest) -> None:
        if body.model != self.serving.model:
            message = f"model {body.model!r} is not served here; this server serves {self.serving.model!r}"
            raise ApiError(404, message, "model", "model_not_found")
        trouble = self.serving.trouble()
        if trouble is not None:
            raise ApiError(503, f"not ready: {trouble}")

    async def _run(self, shape: Shape, args: list[GenerateArgs], body: GenerationRequest, request: Request) -> Response:
        with _bad_value_is_400():  # the front door's refusal
            admitted = await asyncio.gather(*(self.serving.admit(a) for a in args))
        request_id = shape.id_prefix + secrets.token_hex(12)
        if body.stream:
            events = self._events(shape, admitted, request_id, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        tallies = [ChoiceTally(i) for i in range(len(admitted))]
        if not await _unless_disconnected(self._collect(admitted, tallies), request):
            return Response(status_code=CLIENT_GONE)
        failed = next((t for t in tallies if t.finish_reason == "error"), None)
        if failed is not None:
            raise self._failure(failed)
        choices = [shape.choice(t) for t in tallies]
        prompt = len(admitted[0].spec.prompt_token_ids)
        return JSONResponse(
            envelope(shape, request_id, self.serving.model, choices, False, usage(prompt, tallies, self.lookahead))
        )

    async def _collect(self, admitted: list[Admitted], tallies: list[ChoiceTally]) -> None:
        async with contextlib.aclosing(fan_in([self.serving.stream(a) for a in admitted])) as deltas:
            async for i, delta in deltas:
                tallies[i].add(delta)
                if delta.finish_reason == "error":
                    return  # the other choices are aborted

    async def _events(self, shape: Shape, admitted: list[Admitted], request_id: str, include_usage: bool) -> AsyncIterator[str]:
        """The server-sent events of a streamed request; cancelled when its client leaves."""
        model = self.serving.model
        tallies = [ChoiceTally(i) for i in range(len(admitted))]
        for i in range(len(admitted)):
            opening = shape.opening(i)
            if opening is not None:
                yield _event(envelope(shape, request_id, model, [opening], True))
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
                    yield _event(envelope(shape, request_id, model, [shape.piece(tally, delta, offset)], True))
                if delta.finish_reason is not None:
                    yield _event(envelope(shape, request_id, model, [shape.finish(tally)], True))
        if include_usage:
            spent = usage(len(admitted[0].spec.prompt_token_ids), tallies, self.lookahead)
            yield _event(envelope(shape, request_id, model, [], True, spent))
        yield "data: [DONE]\n\n"

    def _failure(self, tally: ChoiceTally) -> ApiError:
        """A request that failed in the pipeline: 503 while the pipeline is in trouble (a stage lost), else 500."""
        status = 503 if self.serving.trouble() is not None else 500
        return ApiError(status, f"the request failed: {tally.error}")


@contextlib.contextmanager
def _bad_value_is_400() -> Iterator[None]:
    """A ValueError (naming the bad value) raised inside is answered 400 with its message."""
    try:
        yield
    except ValueError as e:
        raise ApiError(400, str(e)) from None


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
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
