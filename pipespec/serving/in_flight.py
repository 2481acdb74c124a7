"""Requests in flight per HTTP client, bounded by `limits.requests_per_client` (as gRPC bounds a connection).

    held = in_flight.take(client, n)   # an ApiError 429 naming the limit when over it
    ...                                # admit, run and answer the request
    held.release()                     # once its answer is done (a second call does nothing)

A client is the host its connection comes from; each choice of a request (OpenAI's `n`) counts as a
request, from admission (the front door's work counts too) to the end of its answer.
"""

from __future__ import annotations

from collections import Counter

from pipespec.serving.openai_errors import ApiError


class InFlight:
    def __init__(self, most: int):
        self.most = most  # limits.requests_per_client
        self.counts: Counter[str] = Counter()

    def take(self, client: str, n: int) -> Held:
        """Hold `n` requests for `client`, or an ApiError 429 if that would be over the limit."""
        held = self.counts[client]
        if held + n > self.most:
            message = (
                f"this client has {held} requests in flight and asks for {n} more: over "
                f"limits.requests_per_client ({self.most}), each choice counting as one; retry when some finish"
            )
            raise ApiError(429, message, code="rate_limit_exceeded")
        self.counts[client] += n
        return Held(self, client, n)


class Held:
    """Requests held for a client, until `release()`."""

    def __init__(self, in_flight: InFlight, client: str, n: int):
        self._in_flight, self._client, self._n = in_flight, client, n

    def release(self) -> None:
        if not self._n:
            return
        counts = self._in_flight.counts
        counts[self._client] -= self._n
        if not counts[self._client]:
            del counts[self._client]
        self._n = 0
