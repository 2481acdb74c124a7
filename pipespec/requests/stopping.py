"""Stop rules, applied at commit time and only there: stop tokens (EOS), max tokens, stop strings.

`StopRules.feed` takes committed tokens one at a time and says what to stream and whether to stop.
Text comes from an incremental detokenizer (no re-decoding of the whole answer per token); a stop
string is searched only in the tail it could have completed in. The text streamed excludes the stop
string (OpenAI's convention); the token ids include the token that completed it, and the EOS token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class StepOutcome:
    text: str  # new text to stream
    finish_reason: str | None  # "stop" | "length" | None


class StopRules:
    def __init__(
        self,
        max_new_tokens: int,
        stop_token_ids: frozenset[int],
        stop: Sequence[str],
        detokenizer: Detokenizer | None,
    ):
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.stop = tuple(s for s in stop if s)
        self.detokenizer = detokenizer
        self.count = 0
        self.text = ""  # text streamed so far
        self.held = ""  # text held back because it may be the start of a stop string

    def feed(self, token_id: int) -> StepOutcome:
        self.count += 1
        piece = self.detokenizer.push(token_id) if self.detokenizer is not None else ""
        if token_id in self.stop_token_ids:
            return self._finish(piece + (self.detokenizer.flush() if self.detokenizer else ""), "stop")
        if self.count >= self.max_new_tokens:
            return self._finish(piece + (self.detokenizer.flush() if self.detokenizer else ""), "length")
        return self._emit(piece, final=False)

    def _finish(self, piece: str, reason: str) -> StepOutcome:
        outcome = self._emit(piece, final=True)
        return StepOutcome(outcome.text, outcome.finish_reason or reason)

    def _emit(self, piece: str, final: bool) -> StepOutcome:
        pending = self.held + piece
        self.held = ""
        hits = [at for at in (pending.find(s) for s in self.stop) if at >= 0]
        if hits:  # the earliest stop string wins, whichever is listed first
            at = min(hits)
            self.text += pending[:at]
            return StepOutcome(pending[:at], "stop")
        if not final and self.stop:  # hold back a suffix that could begin a stop string
            keep = max((k for s in self.stop for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
            if keep:
                pending, self.held = pending[:-keep], pending[-keep:]
        self.text += pending
        return StepOutcome(pending, None)
