"""Chat messages: a conversation (system, user and assistant turns) as every way in takes it.

A request gives either one user turn (`prompt`) or a whole conversation (`messages`), rendered by
the front door through the target's chat template (pipespec.requests.tokenization, pipespec.requests.images). A
message's content is text, or a list of parts in the OpenAI shape:

    {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}

A request carries at most one image (the pipeline's target takes one per request): an `image` or
`image_url` part marks where it goes, and the image itself travels once, as the request's `image`.
`conversation` turns what a user gave into `ChatMessage`s and that image, or a ValueError naming
the bad message or part; it is the one parser of OpenAI-shaped messages (the HTTP server hands it
the request's messages as they came). A conversation has at most MAX_MESSAGES messages of at most
MAX_PARTS parts each, whichever way it came in (the front door also charges each message against
`limits.prompt_tokens`, pipespec.requests.frontdoor). Torch-free.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 4096  # messages of one conversation (each costs at least a few tokens of the chat template)
MAX_PARTS = 16  # content parts of one message (text pieces and at most one image)


@dataclass(frozen=True)
class Part:
    """One piece of a message's content: text, or the place of the request's image (`image=True`)."""

    text: str = ""
    image: bool = False


IMAGE = Part(image=True)


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    parts: tuple[Part, ...]

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts)

    @property
    def has_image(self) -> bool:
        return any(p.image for p in self.parts)

    def template_content(self, image: Any | None) -> list[dict]:
        """The content as a processor's chat template reads it: [{"type": "text", "text": ...},
        {"type": "image", "image": image}]; without an image, its part is left out (the text-only view)."""
        return [
            {"type": "image", "image": image} if p.image else {"type": "text", "text": p.text}
            for p in self.parts
            if image is not None or not p.image
        ]


def user(prompt: str) -> tuple[ChatMessage, ...]:
    """One user turn: what `prompt=` means; the image, if any, goes before the text."""
    return (ChatMessage("user", (Part(prompt),)),)


def with_image_first(messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
    """`prompt=` with an image: the image part placed before the text of the last user turn."""
    *rest, last = messages
    return (*rest, ChatMessage(last.role, (IMAGE, *last.parts)))


def conversation(messages: Any) -> tuple[tuple[ChatMessage, ...], Any]:
    """What a user gave as `messages` -> (the messages, the image value an image part carried, or None).

    Each message is a `ChatMessage` or a mapping with `role` and `content` (a string or a list of
    parts: `{"type": "text", "text": ...}`, `{"type": "image"}` (the request's `image=` goes there),
    `{"type": "image", "image": value}` or `{"type": "image_url", "image_url": {"url": value}}`).
    Raises ValueError naming the first bad message or part."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of messages, got {_short(messages)}")
    _within_shape(messages)
    out, images = [], []
    for i, message in enumerate(messages):
        if isinstance(message, ChatMessage):
            out.append(message)
            continue
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a mapping with role and content, got {_short(message)}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise ValueError(f"messages[{i}] has unknown field {extra[0]!r} (a message has role and content)")
        role, content = message.get("role"), message.get("content")
        parts = []
        if isinstance(content, str):
            parts.append(Part(content))
        elif isinstance(content, Sequence) and not isinstance(content, bytes) and content:
            _within_parts(len(content), i)
            for j, raw in enumerate(content):
                part, image = _part(raw, f"messages[{i}].content[{j}]")
                parts.append(part)
                if image is not None:
                    images.append(image)
        else:
            raise ValueError(f"messages[{i}].content must be a string or a non-empty list of parts, got {_short(content)}")
        out.append(ChatMessage(role, tuple(parts)))
    if len(images) > 1:
        raise ValueError(f"messages carry {len(images)} images; a request takes at most one")
    return tuple(out), images[0] if images else None


def check(messages: tuple[ChatMessage, ...]) -> None:
    """Roles known, text that is text, at most one image part, within MAX_MESSAGES and MAX_PARTS; a
    ValueError naming the first bad one."""
    _within_shape(messages)
    for i, message in enumerate(messages):
        _within_parts(len(message.parts), i)
        if message.role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {_short(message.role)}")
        for j, part in enumerate(message.parts):
            if not isinstance(part.text, str):
                raise ValueError(f"messages[{i}].content[{j}].text must be a string, got {_short(part.text)}")
            try:
                part.text.encode()
            except UnicodeEncodeError as e:
                raise ValueError(f"messages[{i}].content[{j}].text is not valid text: {e}") from None
    places = sum(p.image for m in messages for p in m.parts)
    if places > 1:
        raise ValueError(f"messages carry {places} image parts; a request takes at most one image")
    if not any(p.text.strip() for m in messages for p in m.parts):
        raise ValueError("the messages hold no text: give some")


def _within_shape(messages: Sequence) -> None:
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(
            f"{len(messages)} messages are over the {MAX_MESSAGES} a conversation may have (pipespec.requests.chat.MAX_MESSAGES)"
        )


def _within_parts(parts: int, i: int) -> None:
    if parts > MAX_PARTS:
        raise ValueError(
            f"messages[{i}] has {parts} content parts, over the {MAX_PARTS} a message may have (pipespec.requests.chat.MAX_PARTS)"
        )


def _part(raw: Any, where: str) -> tuple[Part, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping with a type, got {_short(raw)}")
    kind = raw.get("type")
    if kind == "text":
        _only(raw, ("type", "text"), where)
        text = raw.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.text must be a string, got {_short(text)}")
        return Part(text), None
    if kind == "image":
        _only(raw, ("type", "image"), where)
        return IMAGE, raw.get("image")
    if kind == "image_url":
        _only(raw, ("type", "image_url"), where)
        spec = raw.get("image_url")
        url = spec.get("url") if isinstance(spec, Mapping) else spec
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}.image_url.url must be a string (a data URL or a file path), got {_short(url)}")
        if isinstance(spec, Mapping):
            _only(spec, ("url", "detail"), f"{where}.image_url")
        return IMAGE, url
    raise ValueError(f"{where}.type must be text, image or image_url, got {_short(kind)}")


def _only(raw: Mapping, known: tuple[str, ...], where: str) -> None:
    extra = sorted(set(raw) - set(known))
    if extra:
        raise ValueError(f"{where} has unknown field {extra[0]!r}")


def _short(value: Any) -> str:
    return reprlib.repr(value)
