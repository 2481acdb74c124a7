"""The coordinator: opens requests on every stage, turns the target's commits into a client stream.

It holds the ledger of committed prefixes, applies the stop rules at commit time, streams deltas,
and on finish sends Close to every stage; each stage answers Closed with its statistics, and the
last delta of a request carries them all. A commit that does not continue the ledger exactly, or a
stage reporting a failure, ends that request (and only that request) with an error.

No torch here: the coordinator sees token ids and text only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from pipespec.ledger import Ledger, LedgerError
from pipespec.links import Link
from pipespec.messages import Close, Closed, Commit, Failed, Message, Open, RequestSpec
from pipespec.outputs import Delta
from pipespec.stats import RequestStats
from pipespec.stopping import Detokenizer, StopRules

log = logging.getLogger(__name__)


@dataclass
class _Live:
    spec: RequestSpec
    rules: StopRules
    queue: asyncio.Queue
    submitted: float
    first_commit: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    closed_by: dict[str, Closed] = field(default_factory=dict)


class Coordinator:
    def __init__(self, stage_names: Sequence[str], detokenizer_factory: Callable[[], Detokenizer] | None):
        self.stage_names = list(stage_names)
        self.stages: list[Link] = []  # upstream to downstream (`connect`)
        self.detokenizer_factory = detokenizer_factory
        self.ledger = Ledger()
        self.live: dict[str, _Live] = {}

    def connect(self, stages: Sequence[Link]) -> None:
        """Give the coordinator its links to every stage, upstream to downstream."""
        if len(stages) != len(self.stage_names):
            raise ValueError(f"{len(stages)} links for the {len(self.stage_names)} stages {self.stage_names}")
        self.stages = list(stages)

    # ---- client side --------------------------------------------------------------------------

    async def generate(self, spec: RequestSpec, stop: Sequence[str] = ()) -> AsyncIterator[Delta]:
        """Open `spec` on every stage and yield its deltas; closing the iterator early aborts it."""
        detok = self.detokenizer_factory() if self.detokenizer_factory else None
        live = _Live(spec, StopRules(spec.max_new_tokens, spec.stop_token_ids, stop, detok), asyncio.Queue(), time.perf_counter())
        self.live[spec.request_id] = live
        self.ledger.open(spec.request_id)
        text_spec = dataclasses.replace(spec, image=None)  # pixels go to the target only
        for i, link in enumerate(self.stages):
            link.send(Open(spec if i == len(self.stages) - 1 else text_spec))
        done = False
        try:
            while not done:
                delta = await live.queue.get()
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.abort(spec.request_id)

    def abort(self, request_id: str) -> None:
        live = self.live.get(request_id)
        if live is not None and live.finish_reason is None:
            self._finish(live, "abort")

    # ---- stage side ---------------------------------------------------------------------------

    def deliver(self, message: Message) -> None:
        live = self.live.get(message.request_id)
        if live is None:
            return
        if isinstance(message, Commit):
            self._on_commit(live, message)
        elif isinstance(message, Closed):
            live.closed_by[message.stage] = message
            if len(live.closed_by) == len(self.stage_names):
                self._complete(live)
        elif isinstance(message, Failed):
            if live.finish_reason is None:
                live.error = f"stage {message.stage!r}: {message.error}"
                self._finish(live, "error")
        else:
            raise TypeError(f"coordinator cannot handle {type(message).__name__}")

    def lost(self, link: Link) -> None:
        """The link to a stage is gone (the stage died, or the stream broke)."""

    def trouble(self) -> str | None:
        """None while the pipeline can serve; else why not (which stages are lost), for health checks."""
        return None

    def _on_commit(self, live: _Live, commit: Commit) -> None:
        if live.finish_reason is not None:
            return  # the target ran past a stop before hearing of it
        rid = commit.request_id
        try:
            self.ledger.append(rid, commit.start, commit.tokens)
        except LedgerError as e:
            log.error("%s", e)
            live.error = str(e)
            self._finish(live, "error")
            return
        if live.first_commit is None:
            live.first_commit = time.perf_counter()
        text, ids, reason = [], [], None
        for token in commit.tokens:
            outcome = live.rules.feed(token)
            text.append(outcome.text)
            ids.append(token)
            if outcome.finish_reason is not None:
                reason = outcome.finish_reason
                break
        live.queue.put_nowait(Delta("".join(text), tuple(ids)))
        if reason is not None:
            self._finish(live, reason)

    def _finish(self, live: _Live, reason: str) -> None:
        live.finish_reason = reason
        live.finished = time.perf_counter()
        for link in self.stages:
            link.send(Close(live.spec.request_id))

    def _complete(self, live: _Live) -> None:
        rid = live.spec.request_id
        del self.live[rid]
        self.ledger.close(rid)
        first = live.first_commit if live.first_commit is not None else live.finished
        order = {name: i for i, name in enumerate(self.stage_names)}
        closed = sorted(live.closed_by.values(), key=lambda c: order[c.stage])
        stats = RequestStats(
            prompt_tokens=len(live.spec.prompt_token_ids),
            generated_tokens=live.rules.count,  # committed tokens streamed, up to a stop
            prefill_s=first - live.submitted,
            decode_s=live.finished - first,
            pairs=[c.pair_stats for c in closed if c.pair_stats is not None],
            stages=[c.stage_stats for c in closed],
        )
        live.queue.put_nowait(Delta("", (), live.finish_reason, stats, live.error))
