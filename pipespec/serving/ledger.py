"""The ledger of committed prefixes: what the target has committed for each request, and nothing else.

Commits arrive as deltas (`start`, `tokens`). A commit whose start is not the committed length is a
protocol bug (a gap or a duplicate): the ledger raises, and the coordinator aborts that request loudly
instead of streaming a corrupted answer.
"""

from __future__ import annotations


class LedgerError(RuntimeError):
    """A commit did not continue the committed prefix exactly."""


class Ledger:
    def __init__(self) -> None:
        self._committed: dict[str, list[int]] = {}

    def open(self, request_id: str) -> None:
        if request_id in self._committed:
            raise LedgerError(f"request {request_id!r} is already open")
        self._committed[request_id] = []

    def append(self, request_id: str, start: int, tokens: tuple[int, ...]) -> None:
        committed = self._committed[request_id]
        if start != len(committed):
            kind = "gap" if start > len(committed) else "duplicate"
            raise LedgerError(f"request {request_id!r}: commit at {start} but {len(committed)} committed ({kind})")
        committed.extend(tokens)

    def tokens(self, request_id: str) -> list[int]:
        return self._committed[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._committed

    def close(self, request_id: str) -> list[int]:
        return self._committed.pop(request_id)
