"""What clients receive: streamed `Delta`s, the `Generation` they add up to, and the errors they raise."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.stats import RequestStats


class GenerationError(RuntimeError):
    """A request failed: it was refused (`RequestRefused`), it ended with an error inside the pipeline
    (the message names the stage), or its coordinator could not be reached or was lost, or ended the
    stream without a finish reason (the message names its address)."""


class RequestRefused(GenerationError, ValueError):
    """A request refused before it started, naming the value: a bad type or range, a missing image file,
    a value over one of the pipeline's limits. A ValueError, as `LocalPipeline` raises for the same
    refusal; a GenerationError, as every failure of a `Client` request is."""


@dataclass(frozen=True)
class Delta:
    """One streamed piece of a generation; the last one has a finish reason and the statistics."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stats: RequestStats | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked for logprobs


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id, when asked for

    @classmethod
    def from_deltas(cls, deltas: Iterable[Delta]) -> Generation:
        ids: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprobs] = []
        for d in deltas:
            ids.extend(d.token_ids)
            text.append(d.text)
            logprobs.extend(d.logprobs)
            if raise_error(d).finish_reason is not None:
                return cls(ids, "".join(text), d.finish_reason, d.stats, logprobs)
        raise GenerationError("the stream ended without a finish reason")


def raise_error(delta: Delta) -> Delta:
    """`delta`, unless it ends its request with an error: then the GenerationError with its message."""
    if delta.finish_reason == "error":
        raise GenerationError(delta.error)
    return delta
