"""The OpenAI API's responses, built from pipespec's deltas: choices, chunks, logprobs and usage.

`ChoiceTally` adds up one choice's deltas. A `Shape` (`ChatShape` for /v1/chat/completions,
`CompletionShape` for /v1/completions) says how a choice looks streamed (`opening`, `piece`,
`finish`) and whole (`choice`); `envelope` wraps choices into a response or chunk under the request's
`Head` (its id, `created` and model: the same on every chunk of a request).

Logprobs come as the target computed them (pipespec.protocol.logprobs.TokenLogprobs), each token named by the
tokenizer's decoding of its id alone (`token_id:N` without a tokenizer); -inf (and NaN) is sent as
-9999.0, as vLLM does, and anything above 0 as 0, so that the JSON is valid (it has no infinity). Chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`;
completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`.

`usage` holds `prompt_tokens`, `completion_tokens` (the tokens streamed, over every choice) and
`total_tokens`, and `speculative_decoding`: one block per drafter -> verifier pair, summed over the
choices, with the fields of vLLM's per-request `metrics.speculative_decoding` (`mean_acceptance_length`,
`draft_acceptance_rate`, `acceptance_histogram`, `num_spec_steps`, `num_accepted_draft_tokens`,
`num_draft_tokens`, `num_spec_tokens`: the drafter's `max_lookahead`) plus the pair's names and
`num_accepted_tokens_per_pos` (the counterpart of the Prometheus counter of that name). vLLM's
`acceptance_histogram_by_draft_length` is left out: the statistics do not keep the draft lengths.
Summed over requests, the blocks equal the `/metrics` counters' increase (pipespec.serving.metrics).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.stats import PairStats, RequestStats, merged_pairs
from pipespec.requests.outputs import Delta

FLOOR = -9999.0  # what -inf is sent as


@dataclass
class ChoiceTally:
    """One choice's deltas, added up."""

    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None
    chars: int = 0  # of the text so far

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.chars += len(delta.text)
        self.tokens += len(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stats, self.error = delta.finish_reason, delta.stats, delta.error


class TokenNames:
    """A token id's text for logprobs: the tokenizer's decoding of that id alone."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.name = lru_cache(maxsize=65536)(self._name)

    def _name(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"token_id:{token}"


def _logprob(value: float) -> float:
    """A logprob JSON can carry: in [FLOOR, 0], NaN as FLOOR."""
    return FLOOR if math.isnan(value) else min(max(value, FLOOR), 0.0)


def chat_logprobs(entries: Sequence[TokenLogprobs], names: TokenNames) -> dict:
    def one(token: int, logprob: float) -> dict:
        name = names.name(token)
        return {"token": name, "logprob": _logprob(logprob), "bytes": list(name.encode())}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def completion_logprobs(entries: Sequence[TokenLogprobs], names: TokenNames, offset: int) -> dict:
    """`offset`: where the first token's text starts in the completion."""
    tokens = [names.name(e.token) for e in entries]
    offsets = []
    for name in tokens:
        offsets.append(offset)
        offset += len(name)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": [{names.name(t): _logprob(lp) for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


class Shape(Protocol):
    """How one endpoint's choices look."""

    object: str  # of the whole response
    chunk_object: str  # of a streamed chunk
    id_prefix: str

    def opening(self, index: int) -> dict | None: ...  # a choice's first chunk, before any token

    def piece(self, tally: ChoiceTally, delta: Delta, offset: int) -> dict: ...  # `offset`: chars before this delta

    def finish(self, tally: ChoiceTally) -> dict: ...

    def choice(self, tally: ChoiceTally) -> dict: ...  # the whole choice, not streamed


@dataclass(frozen=True)
class ChatShape:
    names: TokenNames
    logprobs: bool  # asked for
    object: str = "chat.completion"
    chunk_object: str = "chat.completion.chunk"
    id_prefix: str = "chatcmpl-"

    def opening(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def piece(self, tally: ChoiceTally, delta: Delta, offset: int) -> dict:
        logprobs = chat_logprobs(delta.logprobs, self.names) if self.logprobs else None
        return {"index": tally.index, "delta": {"content": delta.text}, "logprobs": logprobs, "finish_reason": None}

    def finish(self, tally: ChoiceTally) -> dict:
        return {"index": tally.index, "delta": {}, "logprobs": None, "finish_reason": tally.finish_reason}

    def choice(self, tally: ChoiceTally) -> dict:
        return {
            "index": tally.index,
            "message": {"role": "assistant", "content": "".join(tally.text)},
            "logprobs": chat_logprobs(tally.logprobs, self.names) if self.logprobs else None,
            "finish_reason": tally.finish_reason,
        }


@dataclass(frozen=True)
class CompletionShape:
    names: TokenNames
    logprobs: bool
    object: str = "text_completion"
    chunk_object: str = "text_completion"
    id_prefix: str = "cmpl-"

    def opening(self, index: int) -> dict | None:
        return None

    def piece(self, tally: ChoiceTally, delta: Delta, offset: int) -> dict:
        logprobs = completion_logprobs(delta.logprobs, self.names, offset) if self.logprobs else None
        return {"index": tally.index, "text": delta.text, "logprobs": logprobs, "finish_reason": None}

    def finish(self, tally: ChoiceTally) -> dict:
        return {"index": tally.index, "text": "", "logprobs": None, "finish_reason": tally.finish_reason}

    def choice(self, tally: ChoiceTally) -> dict:
        return {
            "index": tally.index,
            "text": "".join(tally.text),
            "logprobs": completion_logprobs(tally.logprobs, self.names, 0) if self.logprobs else None,
            "finish_reason": tally.finish_reason,
        }


@dataclass(frozen=True)
class Head:
    """What every chunk of one request's answer carries the same."""

    id: str
    created: int  # seconds since the epoch, when the request was admitted
    model: str


def envelope(shape: Shape, head: Head, choices: list[dict], chunk: bool, usage: dict | None = None) -> dict:
    out = {
        "id": head.id,
        "object": shape.chunk_object if chunk else shape.object,
        "created": head.created,
        "model": head.model,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, tallies: Sequence[ChoiceTally], lookahead: Mapping[str, int]) -> dict:
    """The usage of a request's choices (the prompt counted once); `lookahead`: each stage's max_lookahead."""
    completion = sum(t.tokens for t in tallies)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "speculative_decoding": [
            speculative_decoding(pair, lookahead.get(pair.drafter, 0))
            for pair in merged_pairs(t.stats.pairs for t in tallies if t.stats is not None)
        ],
    }


def speculative_decoding(pair: PairStats, num_spec_tokens: int) -> dict:
    """One pair's block, with the fields of vLLM's per-request `metrics.speculative_decoding`."""
    per_position = pair.accepted_per_position
    k = max(num_spec_tokens, len(per_position))
    at_least = [pair.num_drafts, *per_position, *[0] * (k - len(per_position)), 0]  # [j]: steps accepting >= j drafts
    return {
        "drafter": pair.drafter,
        "verifier": pair.verifier,
        "mean_acceptance_length": pair.mean_acceptance_length,
        "draft_acceptance_rate": pair.acceptance_rate,
        "acceptance_histogram": [at_least[j] - at_least[j + 1] for j in range(k + 1)],  # [j]: steps accepting exactly j
        "num_spec_steps": pair.num_drafts,
        "num_accepted_draft_tokens": pair.num_accepted_tokens,
        "num_draft_tokens": pair.num_draft_tokens,
        "num_spec_tokens": num_spec_tokens,
        "num_accepted_tokens_per_pos": list(per_position),
    }
