"""Which images an HTTP request may name: data URLs always, files only under the server's allowed directory.

    image = media_image(url, allowed)   # a data URL as it is, or the resolved Path of an allowed file

A client of the OpenAI-compatible server sends an image as an `image_url` part. A `data:` URL
carries the image itself. A file path (or a `file://` URL) is read only when the server was started
with an allowed directory (`allowed_media`) and the path, resolved (symbolic links and `..`
followed; a relative path is taken from that directory), lies under it; anything else is refused
naming the path, before anything is read. http(s) URLs are refused: the server fetches nothing.
The image itself is decoded by the front door (pipespec.requests.images), within the config's limits.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

REMOTE = ("http://", "https://")


def media_image(url: Any, allowed: Path | None) -> str | Path:
    """`url` of an `image_url` part (the image pipespec.requests.chat.conversation found) -> what the front door
    may read: the data URL itself, or the resolved path of a file under `allowed`. Raises ValueError
    naming the URL or path refused."""
    if not isinstance(url, str):
        raise ValueError(f"an image is given as an image_url's url (a data URL or a file path), got {reprlib.repr(url)}")
    if url.startswith("data:"):
        return url
    if url.lower().startswith(REMOTE):
        raise ValueError(f"image_url {url[:200]!r}: http(s) URLs are not fetched; send the image as a data URL")
    path = unquote(urlparse(url).path) if url.startswith("file://") else url
    if allowed is None:
        raise ValueError(
            f"image_url {path[:200]!r}: file paths are refused (this server has no allowed media directory); "
            "send the image as a data URL"
        )
    root = allowed.resolve()
    try:
        resolved = (root / path).resolve()  # an absolute `path` stays itself
    except (OSError, ValueError) as e:  # a NUL byte, a name too long
        raise ValueError(f"image_url {path[:200]!r} is not a usable file path: {e}") from None
    if not resolved.is_relative_to(root):
        raise ValueError(f"image_url {path[:200]!r} is outside the server's allowed media directory")
    return resolved
