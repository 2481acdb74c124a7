"""Links: how a message gets from one pipeline endpoint to another.

Every endpoint (stage runner, coordinator) has an inbox; a `Link` delivers into one. Links are FIFO,
like the gRPC streams and asyncio queues behind them, and `send` never blocks the event loop.
`send_all` sends several messages as one delivery (a gRPC frame, cut only at the frame limit; one item in a
runner's inbox): a stage sends what one forward produced for all the requests it carried that way, so that
its peer's event loop takes one turn for the lot, not one a request.

- `InProcessLink`: same event loop, straight into the peer's inbox (tests, notebooks, LocalPipeline).
- `DelayLink`: a fault-injection wrapper for tests: every message waits a random delay before
  delivery, so drafts, verdicts, commits and closes on different links overtake each other in random
  order (order within one link stays FIFO, as on a real stream).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pipespec.protocol.messages import Message


class Inbox(Protocol):
    """A pipeline endpoint: a stage runner or the coordinator."""

    def deliver(self, message: Message) -> None: ...

    def deliver_all(self, messages: Sequence[Message]) -> None:
        """`messages`, in order, as one delivery: handled one after another, nothing else between them."""
        ...

    def lost(self, link: Link) -> None:
        """`link` (one this endpoint was given) is gone: its peer died or the stream broke."""
        ...


Unsent = tuple[Message, Exception]  # a message a link could not send, and why


class Link(Protocol):
    def send(self, message: Message) -> None: ...

    def send_all(self, messages: Sequence[Message]) -> list[Unsent]:
        """Send `messages`, in order, as one delivery; -> those it could not (too large for a frame, say), each with
        why: the others went."""
        ...


class InProcessLink:
    def __init__(self, peer: Inbox):
        self.peer = peer

    def send(self, message: Message) -> None:
        self.peer.deliver(message)

    def send_all(self, messages: Sequence[Message]) -> list[Unsent]:
        self.peer.deliver_all(messages)
        return []


class DelayLink:
    """Delays each message by uniform(0, max_delay_s), keeping this link's FIFO order."""

    def __init__(self, peer: Inbox, max_delay_s: float, rng: random.Random):
        self.peer = peer
        self.max_delay_s = max_delay_s
        self.rng = rng
        self.last_due = 0.0

    def send(self, message: Message) -> None:
        self._later(self.peer.deliver, message)

    def send_all(self, messages: Sequence[Message]) -> list[Unsent]:
        self._later(self.peer.deliver_all, tuple(messages))
        return []

    def _later(self, deliver: Callable[[Any], None], what: Any) -> None:
        loop = asyncio.get_running_loop()
        # strictly increasing: the loop's timer heap does not keep equal deadlines in order
        due = max(self.last_due + 1e-9, loop.time() + self.rng.uniform(0.0, self.max_delay_s))
        self.last_due = due
        loop.call_at(due, deliver, what)
