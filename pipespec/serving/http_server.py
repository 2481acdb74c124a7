"""The OpenAI-compatible HTTP server on the coordinator's event loop (uvicorn running the FastAPI app).

server = await serve_http(serving, host="127.0.0.1", port=8000, allowed_media=None)
...                     # server.port: the port bound (port 0 picks a free one)
await server.stop()

uvicorn's `Server.serve()` runs as a task on the running loop, the coordinator's, since the
coordinator is not thread-safe: every request is handled where the coordinator runs. The socket is
bound here first, so that a port in use is an OSError naming it, and `serve_http` returns once
uvicorn accepts connections. uvicorn leaves the process's logging alone (its loggers, `uvicorn.error`
and `uvicorn.access`, log through whatever the process configured), and its signals only when the
loop runs off the main thread: on the main thread, `serve()` takes SIGINT and SIGTERM while it runs
(one stops the HTTP server, then is raised again to the handler before it). `stop()` stops
accepting, closes idle connections, lets running responses finish for up to `GRACE_S`, then
cancels them (aborting their requests).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import uvicorn

from pipespec.serving.openai_app import build_app
from pipespec.serving.serving import Serving

GRACE_S = 3.0  # how long stop() lets running responses finish


class HttpServer:
    """A running server: `port` is the one bound; `stop()` shuts it down."""

    def __init__(self, server: _Uvicorn, task: asyncio.Task, port: int):
        self._server = server
        self._task = task
        self.port = port

    async def stop(self) -> None:
        self._server.should_exit = True
        await self._task


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, saying when it accepts connections."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.accepting = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.accepting.set()


async def serve_http(serving: Serving, host: str, port: int, allowed_media: Path | None = None) -> HttpServer:
    """Start serving on the running loop; returns once the socket is bound. `allowed_media`: the
    directory under which `image_url` file paths may be read (None: no file paths, data URLs only)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise OSError(e.errno, f"cannot serve HTTP on {host}:{port}: {e.strerror}") from e
    config = uvicorn.Config(build_app(serving, allowed_media), lifespan="off", log_config=None, timeout_graceful_shutdown=GRACE_S)
    server = _Uvicorn(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"http-{host}:{port}")
    accepting = asyncio.create_task(server.accepting.wait())
    await asyncio.wait({task, accepting}, return_when=asyncio.FIRST_COMPLETED)
    if not accepting.done():  # uvicorn ended before it started
        accepting.cancel()
        sock.close()
        task.result()
        raise RuntimeError(f"the HTTP server on {host}:{port} stopped as it started")
    return HttpServer(server, task, sock.getsockname()[1])
