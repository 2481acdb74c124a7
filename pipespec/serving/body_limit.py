"""A cap on the size of an HTTP request body, checked before the body is read (ASGI middleware).

The OpenAI endpoints take JSON that may hold an image as a base64 data URL and text escaped as JSON,
so the cap is twice the largest request the front door could accept (pipespec.requests.frontdoor
`request_bytes`: an image at `limits.image_bytes`, a prompt at `limits.prompt_tokens`, ...). A body
over it, by its `Content-Length` or as it streams in, is refused with 413 in OpenAI's error shape,
naming both sizes, before it is parsed: a client cannot make the server hold more than the limits
allow.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException

from pipespec.config import LimitsSpec
from pipespec.requests.frontdoor import request_bytes
from pipespec.serving.openai_errors import ApiError

Scope = dict[str, Any]


def body_bytes(limits: LimitsSpec) -> int:
    """The largest body read: twice the largest request (base64 adds a third, JSON escapes more)."""
    return 2 * request_bytes(limits)


class BodyLimit:
    """`app` behind a cap of `most` bytes on every request body."""

    def __init__(self, app: Any, most: int):
        self.app = app
        self.most = most

    def _error(self, size: str) -> str:
        return f"the request body of {size} bytes is over the {self.most} bytes this server reads (twice its limits' largest request)"

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.most:
            await ApiError(413, self._error(declared.decode())).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.most:  # a body without a Content-Length (chunked): refused as it grows
                    raise HTTPException(413, self._error(f"{seen}+"))
            return message

        await self.app(scope, counted, send)
