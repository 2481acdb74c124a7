"""`GenerateArgs`: one request's arguments, as every way in takes them, checked where they are built.

The keywords of `LocalPipeline.generate` and `Client.stream` / `generate`, held in one value: the
front door validates it against a pipeline into a `RequestSpec` (pipespec.requests.frontdoor), and
the transport carries it as a `GenerateRequest` (pipespec.transport.generate_request, the one place
that maps it to the wire). Sampling values left as None take the pipeline config's defaults (its
`sampling` section).

A `GenerateArgs` holds only good values: building one is the one check of types and ranges (a
prompt given once and not empty, integers that are integers, finite numbers in range, non-empty stop
strings), in `__post_init__`, so that a bad value is refused with the same message whichever way it
came in (LocalPipeline, the Client before it sends, the coordinator when it reads the wire, the
OpenAI server). Its values are kept in plain Python types (ints, floats, tuples of them; messages as
`ChatMessage`s, an image given in a message part moved to `image`); `dataclasses.replace` builds a
new one, checked the same way. What needs the pipeline (its config's `limits`, its tokenizer, its
target) is the front door's, which takes a `GenerateArgs` as it is. Torch-free.

`max_new_tokens`, one meaning on every way in:

- a number: at most that many new tokens (the front door refuses one over `limits.max_new_tokens` or
  beyond the room the target's context leaves after the prompt);
- None (`max_new_tokens=None` given to `LocalPipeline` or the `Client`, the wire's `max_new_tokens`
  unset, the OpenAI API's `max_tokens` / `max_completion_tokens` left out or null): as many as the
  pipeline's limits allow, that is `limits.max_new_tokens` or the room the target's context leaves
  after the prompt, whichever is less (what OpenAI and vLLM mean by leaving `max_tokens` out); the
  front door works the number out (`FrontDoor.request`);
- the keyword left out of the Python API (and `pipespec generate` without `--max-new-tokens`, its
  parser's default): DEFAULT_MAX_NEW_TOKENS, the documented default of `generate(..., max_new_tokens=64)`; a client
  sends it as a number, so it means the same on the server.
"""

from __future__ import annotations

import numbers
import operator
import reprlib
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from pipespec.protocol.params import SamplingParams
from pipespec.requests import chat
from pipespec.requests.chat import ChatMessage

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")  # None: the config's default
INTEGERS = 2**63  # an integer a request carries is below this (the wire's int64; a seed, below 2**64)
MAX_LOGPROBS = 5  # the most top alternatives a request may ask for each token
DEFAULT_MAX_NEW_TOKENS = 64  # the Python API's `max_new_tokens` when the keyword is left out (design 6)


@dataclass(frozen=True)
class GenerateArgs:
    """`generate(prompt=None, *, prompt_token_ids=None, messages=None, ...)`'s keywords: give exactly
    one of `prompt` (one user turn), `messages` (a conversation, pipespec.requests.chat) and `prompt_token_ids`
    (which bypasses tokenizer and chat template). `prompt_token_ids`, `messages` and `stop` may be
    any sequence; they are kept as tuples (`stop` may also be one string). `logprobs=k` asks for each
    generated token's log-probability under the target and its k most likely alternatives.
    `max_new_tokens`: a number, or None for as many as the pipeline's limits allow (the module's
    docstring has its one meaning). Built only from good values: a ValueError names the first bad one."""

    prompt: str | None = None
    _: KW_ONLY
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None  # ChatMessages; given: also OpenAI-shaped mappings
    image: Any = None  # a PIL image, encoded bytes, a path or a URL (pipespec.requests.images); encoded bytes on the wire
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: as many as the pipeline's limits allow
    temperature: float | None = None  # None: the config's default
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # in [0, 2**64)
    stop: tuple[str, ...] = ()  # stop strings; None is none
    logprobs: int | None = None  # None: none; k in [0, MAX_LOGPROBS]: each token's and its k top alternatives'

    def __post_init__(self) -> None:
        """The one check: these arguments in plain Python types, or a ValueError naming the first bad
        value. The image itself is left to the front door (pipespec.requests.images)."""
        for name, value in _checked(self).items():
            object.__setattr__(self, name, value)

    def sampling(self) -> dict[str, float | int | None]:
        """The sampling overrides, None where the config's default applies."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}

    def conversation(self) -> tuple[ChatMessage, ...]:
        """The messages to render through the chat template: `messages`, or `prompt` as one user turn
        (its image placed before its text). Of arguments with a text prompt."""
        if self.messages is not None:
            return self.messages
        messages = chat.user(self.prompt)
        return chat.with_image_first(messages) if self.image is not None else messages


def _checked(args: GenerateArgs) -> dict[str, Any]:
    """`args`' fields in plain Python types (those that change), or a ValueError naming the first bad value."""
    prompt, ids, messages, image = args.prompt, _as_tuple(args.prompt_token_ids), args.messages, args.image
    given = [name for name, value in (("prompt", prompt), ("prompt_token_ids", ids), ("messages", messages)) if value is not None]
    if not given:
        raise ValueError("no prompt: give prompt, messages or prompt_token_ids")
    if len(given) > 1:
        raise ValueError(f"give exactly one of prompt, messages and prompt_token_ids, not {' and '.join(given)}")
    if prompt is not None:
        _text("prompt", prompt)
        if not prompt.strip():
            raise ValueError("the prompt is empty: give some text (or prompt_token_ids)")
    elif messages is not None:
        messages, carried = chat.conversation(tuple(messages) if isinstance(messages, list) else messages)
        chat.check(messages)
        if carried is not None and image is not None:
            raise ValueError("the image is given twice: in a message part and as image=; give one")
        image = carried if carried is not None else image
        places = any(m.has_image for m in messages)
        if image is not None and not places:
            raise ValueError('an image needs its place in the messages: a {"type": "image"} part')
        if places and image is None:
            raise ValueError("the messages have an image part but no image is given (image=, or the part's image or image_url)")
    else:
        ids = _token_ids(ids)
    max_new_tokens = _integer("max_new_tokens", args.max_new_tokens, "a positive integer")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {_short(args.max_new_tokens)}")
    sampling = {
        "temperature": _number("temperature", args.temperature),
        "top_p": _number("top_p", args.top_p),
        "top_k": _integer("top_k", args.top_k, "an integer"),
        "seed": _integer("seed", args.seed, "an integer", None),  # its range: SamplingParams
    }
    SamplingParams(**{name: value for name, value in sampling.items() if value is not None})  # the ranges
    stop = args.stop
    stop = () if stop is None else (stop,) if isinstance(stop, str) else _as_tuple(stop)
    if not isinstance(stop, tuple):
        raise ValueError(f"stop must be a string or a list of strings, got {_short(args.stop)}")
    for i, one in enumerate(stop):
        _text(f"stop[{i}]", one)
        if not one:
            raise ValueError(f"stop[{i}] is empty: a stop string needs at least one character")
    logprobs = _integer("logprobs", args.logprobs, f"an integer in [0, {MAX_LOGPROBS}]")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (top alternatives per token), got {logprobs}")
    return dict(
        prompt_token_ids=ids,
        messages=messages,
        image=image,
        max_new_tokens=max_new_tokens,
        stop=stop,
        logprobs=logprobs,
        **sampling,
    )


def _as_tuple(value: Any) -> Any:
    """A list or other iterable (not a string) as a tuple; anything else as it is, for `_checked` to name."""
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
