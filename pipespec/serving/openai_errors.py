"""Errors of the OpenAI-compatible server, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

400 for a bad value, naming it (the field in `param`, by the name the request gave it): a body that
is not JSON, a field of the wrong type, an unknown field (by name), and every refusal of the front
door (a value out of range, an image that does not decode, a prompt too long, a file outside the
allowed directory). 413 for a body over the size the limits allow (pipespec.serving.body_limit). 429
for a client over `limits.requests_per_client` requests in flight (pipespec.serving.in_flight). 404 for
a model or path not served, 503 while the pipeline refuses requests (`Serving.refusal()`), 500 only
for a bug: logged with its traceback under a short id, which the answer names (and nothing else of it).
"""

from __future__ import annotations

import logging
import re
import reprlib
import secrets
from collections.abc import Collection, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
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
        incident = secrets.token_hex(4)
        log.error("bug %s while serving %s %s", incident, request.method, request.url.path, exc_info=error)
        return ApiError(500, f"internal error {incident} (the server's log has it)").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, bug)


def bad_value(message: str, renamed: Mapping[str, str], fields: Collection[str]) -> ApiError:
    """The front door's refusal as a 400: its names of fields as the request named them (`renamed`:
    GenerateArgs' name -> the request's; a config limit, `limits.<name>`, keeps its name), and the
    first of the request's `fields` it names (`stop[0]`, `messages[1].role`) as `param`."""
    for ours, theirs in renamed.items():
        message = re.sub(rf"(?<![\w.]){ours}\b", theirs, message)
    named = (m.group(0) for m in re.finditer(r"(?<![\w.'])[a-z_]+(?:\[\d+\]|\.[a-z_]+)*", message))
    param = next((name for name in named if re.split(r"[\[.]", name)[0] in fields), None)
    return ApiError(400, message, param)


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
