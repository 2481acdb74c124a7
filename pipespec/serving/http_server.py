"""The OpenAI-compatible HTTP server on the coordinator's event loop (uvicorn running the FastAPI app).

server = await serve_http(serving, host="127.0.0.1", port=8000, allowed_media=None)
...                     # server.port: the port bound (port 0 picks a free one)
await server.stop()
"""

from __future__ import annotations

from pathlib import Path

from pipespec.serving.serving import Serving


class HttpServer:
    port: int

    async def stop(self) -> None:
        raise NotImplementedError  # TODO(openai helper)


async def serve_http(serving: Serving, host: str, port: int, allowed_media: Path | None = None) -> HttpServer:
    """Start serving on the running loop; returns once the socket is bound. `allowed_media`: the
    directory under which `image_url` file paths may be read (None: no file paths, data URLs only)."""
    raise NotImplementedError  # TODO(openai helper)
