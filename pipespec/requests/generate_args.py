"""`GenerateArgs`: one request's arguments, as every way in takes them, and the checks that need no pipeline.

The keywords of `LocalPipeline.generate` and `Client.stream` / `generate`, held in one value: the
front door validates it into a `RequestSpec` (pipespec.requests.frontdoor), and the transport carries it as a
`GenerateRequest` (pipespec.transport.generate_request, the one place that maps it to the wire).
Sampling values left as None take the pipeline config's defaults (its `sampling` section).

A `GenerateArgs` may hold a bad value, so that it is refused the same way everywhere: `checked()`
is the one check of types and ranges (a prompt given once and not empty, integers that are
integers, finite numbers in range, non-empty stop strings), run by the front door on every request
whichever way it came in, and by clients to refuse early with the same message. What needs the
pipeline (its config's `limits`, its tokenizer, its target) is the front door's. Torch-free.
"""

from __future__ import annotations

import numbers
import operator
import reprlib
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any

from pipespec.requests import chat
from pipespec.requests.chat import ChatMessage
from pipespec.protocol.params import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")  # None: the config's default
INTEGERS = 2**63  # an integer a request carries is below this (the wire's int64; a seed, below 2**64)
MAX_LOGPROBS = 5  # the most top alternatives a request may ask for each token


@dataclass(frozen=True)
class GenerateArgs:
    """`generate(prompt=None, *, prompt_token_ids=None, messages=None, ...)`'s keywords: give exactly
    one of `prompt` (one user turn), `messages` (a conversation, pipespec.requests.chat) and `prompt_token_ids`
    (which bypasses tokenizer and chat template). `prompt_token_ids`, `messages` and `stop` may be
    any sequence; they are kept as tuples (`stop` may also be one string). `logprobs=k` asks for each
    generated token's log-probability under the target and its k most likely alternatives.
    `max_new_tokens=None` asks for as many tokens as the config's limits and the target's context allow
    (pipespec.requests.frontdoor; the OpenAI server's `max_tokens` left out); the gRPC wire reads an unset
    `max_new_tokens` as the default, 64."""

    prompt: str | None = None
    _: KW_ONLY
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None  # checked: ChatMessages; given: also OpenAI-shaped mappings
    image: Any = None  # a PIL image, encoded bytes, a path or a URL (pipespec.requests.images); encoded bytes on the wire
    max_new_tokens: int | None = 64
    temperature: float | None = None  # None: the config's default
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # in [0, 2**64)
    stop: tuple[str, ...] = ()  # stop strings; None is none
    logprobs: int | None = None  # None: none; k in [0, MAX_LOGPROBS]: each token's and its k top alternatives'

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", _as_tuple(self.prompt_token_ids))
        if isinstance(self.messages, list):
            object.__setattr__(self, "messages", tuple(self.messages))
        stop = self.stop
        object.__setattr__(self, "stop", () if stop is None else (stop,) if isinstance(stop, str) else _as_tuple(stop))

    def sampling(self) -> dict[str, float | int | None]:
        """The sampling overrides, None where the config's default applies."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}

    def conversation(self) -> tuple[ChatMessage, ...]:
        """The messages to render through the chat template: `messages`, or `prompt` as one user turn
        (its image placed before its text). Of checked arguments with a text prompt."""
        if self.messages is not None:
            return self.messages
        messages = chat.user(self.prompt)
        return chat.with_image_first(messages) if self.image is not None else messages

    def checked(self) -> GenerateArgs:
        """These arguments in plain Python types (ints, floats, tuples of them; messages as
        `ChatMessage`s, an image given in a message part moved to `image`), or a ValueError naming the
        first bad value. The image itself is left to the front door (pipespec.requests.images)."""
        prompt, ids, messages, image = self.prompt, self.prompt_token_ids, self.messages, self.image
        given = [
            name for name, value in (("prompt", prompt), ("prompt_token_ids", ids), ("messages", messages)) if value is not None
        ]
        if not given:
            raise ValueError("no prompt: give prompt, messages or prompt_token_ids")
        if len(given) > 1:
            raise ValueError(f"give exactly one of prompt, messages and prompt_token_ids, not {' and '.join(given)}")
        if prompt is not None:
            _text("prompt", prompt)
            if not prompt.strip():
                raise ValueError("the prompt is empty: give some text (or prompt_token_ids)")
        elif messages is not None:
            messages, carried = chat.conversation(messages)
            chat.check(messages)
            if carried is not None and image is not None:
                raise ValueError("the image is given twice: in a message part and as image=; give one")
            image = carried if carried is not None else image
            places = any(m.has_image for m in messages)
            if image is not None and not places:
                raise ValueError('an image needs its place in the messages: a {"type": "image"} part')
            if places and image is None:
                raise ValueError(
                    "the messages have an image part but no image is given (image=, or the part's image or image_url)"
                )
        else:
            ids = _token_ids(ids)
        max_new_tokens = _integer("max_new_tokens", self.max_new_tokens, "a positive integer")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {_short(self.max_new_tokens)}")
        sampling = {
            "temperature": _number("temperature", self.temperature),
            "top_p": _number("top_p", self.top_p),
            "top_k": _integer("top_k", self.top_k, "an integer"),
            "seed": _integer("seed", self.seed, "an integer", None),  # its range: SamplingParams
        }
        SamplingParams(**{name: value for name, value in sampling.items() if value is not None})  # the ranges
        if not isinstance(self.stop, tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {_short(self.stop)}")
        for i, stop in enumerate(self.stop):
            _text(f"stop[{i}]", stop)
            if not stop:
                raise ValueError(f"stop[{i}] is empty: a stop string needs at least one character")
        logprobs = _integer("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}]")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (top alternatives per token), got {logprobs}")
        return replace(
            self,
            prompt_token_ids=ids,
            messages=messages,
            image=image,
            max_new_tokens=max_new_tokens,
            logprobs=logprobs,
            **sampling,
        )


def _as_tuple(value: Any) -> Any:
    """A list or other iterable (not a string) as a tuple; anything else as it is, for `checked` to name."""
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, bytearray, memoryview)):
        return tuple(value)
    return value


def _short(value: Any) -> str:
    return reprlib.repr(value)  # a huge value is named, not printed


def _as_int(value: Any) -> int | None:
    """An integer (Python's, numpy's, a one-element integer tensor) as an int; None for anything else, bools included."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _integer(name: str, value: Any, kind: str, end: int | None = INTEGERS) -> Any:
    """`value` as an int below `end` (None stays None); `kind` says what it must be."""
    if value is None:
        return None
    number = _as_int(value)
    if number is None:
        raise ValueError(f"{name} must be {kind}, got {_short(value)}")
    if end is not None and number >= end:
        raise ValueError(f"{name} must be {kind} below 2**{end.bit_length() - 1}, got {number}")
    return number


def _number(name: str, value: Any) -> float | None:
    """`value` as a float (None stays None); whether it is finite and in range, SamplingParams says."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_short(value)}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got {_short(value)}") from None


def _text(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {_short(value)}")
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid text: {e}") from None


def _token_ids(ids: Any) -> tuple[int, ...]:
    if not isinstance(ids, tuple):
        raise ValueError(f"prompt_token_ids must be a sequence of token ids, got {_short(ids)}")
    if not ids:
        raise ValueError("prompt_token_ids is empty: at least one token is needed")
    out = tuple(_as_int(t) for t in ids)
    for i, t in enumerate(out):
        if t is None or not 0 <= t < INTEGERS:
            raise ValueError(f"prompt_token_ids[{i}] must be a token id (an integer in [0, 2**63)), got {_short(ids[i])}")
    return out
