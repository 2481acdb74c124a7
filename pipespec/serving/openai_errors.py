"""Errors of the OpenAI-compatible server, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

400 for a bad value, naming it: a body that is not JSON, a field of the wrong type, an unknown field
(by name), and every refusal of the front door (a value out of range, an image that does not decode,
a prompt too long, a file outside the allowed directory). 413 for a body over the size the limits allow
(pipespec.serving.body_limit). 404 for a model or path not served, 503
while the pipeline is not ready (`Serving.trouble()`), 500 only for a bug (logged with its traceback).
"""

from __future__ import annotations

import logging
import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
    500: "server_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error `app` answers, in OpenAI's shape."""

    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error.errors())
        return ApiError(400, message, param).response()

    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return ApiError(error.status_code, str(error.detail)).response()

    async def bug(request: Request, error: Exception) -> JSONResponse:
        log.error("bug while serving %s %s", request.method, request.url.path, exc_info=error)
        return ApiError(500, f"internal error: {type(error).__name__}: {error}").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, bug)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """The first of pydantic's errors of a request body -> (a message naming the field, the field)."""
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    error = unknown[0] if unknown else max(errors, key=lambda e: len(e["loc"]))  # the most specific
    if error["type"] == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}", None
    where = _field(error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown field {where!r}: not supported", where
    if error["type"] == "missing":
        return f"{where} is required", where
    return f"{where or 'the request body'}: {error['msg']}, got {reprlib.repr(error.get('input'))}", where or None


def _field(loc: tuple) -> str:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (union members left out)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _union_member(part):
            out += f".{part}" if out else part
    return out


def _union_member(part: str) -> bool:
    """pydantic's name of a union member it tried (`str`, `list[int]`, `tagged-union[...]`), not a field."""
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list")
