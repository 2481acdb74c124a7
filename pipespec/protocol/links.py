"""Links: how a message gets from one pipeline endpoint to another.

Every endpoint (stage runner, coordinator) has an inbox; a `Link` delivers into one. Links are FIFO,
like the gRPC streams and asyncio queues behind them, and `send` never blocks the event loop.

- `InProcessLink`: same event loop, straight into the peer's inbox (tests, notebooks, LocalPipeline).
- `DelayLink`: a fault-injection wrapper for tests: every message waits a random delay before
  delivery, so drafts, verdicts, commits and closes on different links overtake each other in random
  order (order within one link stays FIFO, as on a real stream).
"""

from __future__ import annotations

import asyncio
import random
from typing import Protocol

from pipespec.protocol.messages import Message


class Inbox(Protocol):
    """A pipeline endpoint: a stage runner or the coordinator."""

    def deliver(self, message: Message) -> None: ...

    def lost(self, link: Link) -> None:
        """`link` (one this endpoint was given) is gone: its peer died or the stream broke."""
        ...


class Link(Protocol):
    def send(self, message: Message) -> None: ...


class InProcessLink:
    def __init__(self, peer: Inbox):
        self.peer = peer

    def send(self, message: Message) -> None:
        self.peer.deliver(message)


class DelayLink:
    """Delays each message by uniform(0, max_delay_s), keeping this link's FIFO order."""

    def __init__(self, peer: Inbox, max_delay_s: float, rng: random.Random):
        self.peer = peer
        self.max_delay_s = max_delay_s
        self.rng = rng
        self.last_due = 0.0

    def send(self, message: Message) -> None:
        loop = asyncio.get_running_loop()
        # strictly increasing: the loop's timer heap does not keep equal deadlines in order
        due = max(self.last_due + 1e-9, loop.time() + self.rng.uniform(0.0, self.max_delay_s))
        self.last_due = due
        loop.call_at(due, self.peer.deliver, message)
