"""EarlyMail: the messages that overtook their request's Open, held by a stage runner until it comes.

The coordinator's Open and a neighbour's first Draft, Verdict or TargetFeatures travel on different
links, so the latter may arrive first; the runner replays them right after the Open. A peer could
send messages for requests that never open, so the mail is bounded: at most `per_request` messages
per request (more are dropped) and `total` in all (beyond it the oldest request's are forgotten:
a request opens soon after its first messages came). A request that loses messages here either
fails on its next message (a gap, a verdict beyond its tokens: pipespec.errors.ProtocolError) or
goes on without them (its verifier generates alone); its output stays exact.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from pipespec.protocol.messages import Draft, TargetFeatures, Verdict

log = logging.getLogger(__name__)

PER_REQUEST = 256  # far more than overtake an Open in normal operation (about a drafter's lookahead)
TOTAL = 4096

Early = Draft | Verdict | TargetFeatures


class EarlyMail:
    def __init__(self, stage: str, per_request: int = PER_REQUEST, total: int = TOTAL):
        self.stage = stage
        self.per_request = per_request
        self.total = total
        self.held: OrderedDict[str, list[Early]] = OrderedDict()  # request id -> its messages, oldest request first
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def hold(self, rid: str, message: Early) -> None:
        """Keep `message` until `rid` opens (or drop it, logged, if over a bound)."""
        waiting = self.held.get(rid)
        if waiting is not None and len(waiting) >= self.per_request:
            log.error(
                "stage %s: dropped a %s for request %s: over %d messages came before its Open",
                self.stage,
                type(message).__name__,
                rid,
                self.per_request,
            )
            return
        while self.count >= self.total:
            old, dropped = self.held.popitem(last=False)
            self.count -= len(dropped)
            log.error(
                "stage %s: dropped %d messages for request %s: over %d came before their Opens",
                self.stage,
                len(dropped),
                old,
                self.total,
            )
        self.held.setdefault(rid, []).append(message)
        self.count += 1

    def release(self, rid: str) -> list[Early]:
        """`rid`'s messages, in the order they came; they are no longer held."""
        messages = self.held.pop(rid, [])
        self.count -= len(messages)
        return messages
