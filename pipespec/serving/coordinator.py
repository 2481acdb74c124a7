"""The coordinator: opens requests on every stage, turns the target's commits into a client stream.

It holds the ledger of committed prefixes, applies the stop rules at commit time, streams deltas (with the
target's logprobs of their tokens, when the request asks for them), and on finish sends Close to every stage;
each stage answers Closed with its statistics, and the last delta of a request carries them all. A first stage
that learns from commits (a STAND drafter) is sent each one as the client gets it, with the target's top
logprobs (`learns_top`). A commit that does not continue the ledger exactly (or lacks the logprobs asked for),
or a stage reporting a failure, ends that request (and only that request) with an error.

Faults (design 5c). When the link to a stage is lost (`lost`), no request waits for that stage's
Closed. A lost drafter costs speed only: its verifier goes on alone. A lost target stalls its
requests: each fails, naming the stage, unless the target is restored within `restore_s`; new
requests are refused meanwhile. When a stage is restored (`restored`), every running request
rejoins: it is re-opened on every stage from its committed prefix under a fresh wire id (an
incarnation), so no message of the old one can be mistaken for the new one and every link starts
at epoch 0; what was speculative is re-derived, and no committed token can change.

Draining (pipespec.serving.drain): while `draining` says why, new requests are refused with it; `idle`
is set while no request is live, and `fail` ends one with an error naming why.

No torch here: the coordinator sees token ids and text only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pipespec.config import FaultSpec
from pipespec.protocol.links import Link
from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.messages import Close, Closed, Commit, Failed, Message, Open, RequestSpec
from pipespec.protocol.stats import RequestStats
from pipespec.requests.outputs import Delta
from pipespec.requests.stopping import Detokenizer, StopRules
from pipespec.serving.ledger import Ledger, LedgerError

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
    wire: str = ""  # the request's id on the stages: its own, then a fresh one per rejoin
    rejoins: int = 0
    opened_on: set[int] = field(default_factory=set)  # stages that hold this incarnation and will answer Closed
    closed_by: dict[str, Closed] = field(default_factory=dict)


class Coordinator:
    def __init__(
        self,
        stage_names: Sequence[str],
        detokenizer_factory: Callable[[], Detokenizer] | None,
        restore_s: float = FaultSpec.restore_s,
        learns_top: int = 0,
    ):
        """`learns_top` > 0: the first stage learns from the target's commits (a STAND drafter): each commit is relayed
        to it, the target's `learns_top` likeliest tokens at each position with it, whatever logprobs the client asked."""
        self.stage_names = list(stage_names)
        self.learns_top = learns_top
        self.stages: list[Link | None] = []  # upstream to downstream (`connect`); None: lost
        self.detokenizer_factory = detokenizer_factory
        self.restore_s = restore_s  # how long a request waits for a lost target
        self.ledger = Ledger()
        self.live: dict[str, _Live] = {}  # by the client's request id
        self.wires: dict[str, _Live] = {}  # by the id the stages know it by
        self.lost_at: dict[int, float] = {}  # stage index -> when its link was lost
        self.any_lost = asyncio.Event()  # set while some stage's link is lost (pipespec.cluster.supervisor waits on it)
        self.draining: str | None = None  # why new requests are refused while the server drains (None: not draining)
        self.idle = asyncio.Event()  # set while no request is live (pipespec.serving.drain waits on it)
        self.idle.set()

    def connect(self, stages: Sequence[Link]) -> None:
        """Give the coordinator its links to every stage, upstream to downstream."""
        if len(stages) != len(self.stage_names):
            raise ValueError(f"{len(stages)} links for the {len(self.stage_names)} stages {self.stage_names}")
        self.stages = list(stages)

    # ---- client side --------------------------------------------------------------------------

    async def generate(self, spec: RequestSpec, stop: Sequence[str] = ()) -> AsyncIterator[Delta]:
        """Open `spec` on every stage and yield its deltas; closing the iterator early aborts it."""
        refusal = self.refusal()
        if refusal is not None:
            yield Delta("", (), "error", None, refusal)
            return
        detok = self.detokenizer_factory() if self.detokenizer_factory else None
        live = _Live(spec, StopRules(spec.max_new_tokens, spec.stop_token_ids, stop, detok), asyncio.Queue(), time.perf_counter())
        self.live[spec.request_id] = live
        self.idle.clear()
        self.ledger.open(spec.request_id)
        self._open(live, spec.request_id)
        done = False
        try:
            while not done:
                delta = await live.queue.get()
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.abort(spec.request_id)

    def _open(self, live: _Live, wire: str) -> None:
        """Open `live` on every stage reachable now as `wire`, from its committed prefix."""
        live.wire = wire
        self.wires[wire] = live
        live.closed_by.clear()
        spec = dataclasses.replace(live.spec, request_id=wire, committed=tuple(self.ledger.tokens(live.spec.request_id)))
        if self.learns_top:  # the target sends at least the learner's top logprobs
            spec = dataclasses.replace(spec, logprobs=max(spec.logprobs or 0, self.learns_top))
        text_spec = dataclasses.replace(spec, image=None)  # pixels go to the target only
        last = len(self.stages) - 1
        live.opened_on = set()
        for i, link in enumerate(self.stages):
            if link is None:
                continue
            try:
                link.send(Open(spec if i == last else text_spec))
            except ValueError as error:  # over a limit of the link (an image too large for a frame)
                live.error = f"stage {self.stage_names[i]!r}: cannot open the request: {error}"
                self._finish(live, "error")
                return
            live.opened_on.add(i)

    def abort(self, request_id: str) -> None:
        live = self.live.get(request_id)
        if live is not None and live.finish_reason is None:
            self._finish(live, "abort")

    def fail(self, request_id: str, why: str) -> None:
        """End a running request with an error saying `why` (its client gets it as any failure's)."""
        live = self.live.get(request_id)
        if live is not None and live.finish_reason is None:
            live.error = why
            self._finish(live, "error")

    def complete_now(self, request_id: str) -> None:
        """Complete a finished request without waiting any longer for the stages that have not closed it (their
        statistics left out; a Closed of theirs that comes later is dropped): for a server about to stop."""
        live = self.live.get(request_id)
        if live is not None and live.finish_reason is not None:
            live.opened_on = {i for i in live.opened_on if self.stage_names[i] in live.closed_by}
            self._complete_if_closed(live)

    # ---- stage side ---------------------------------------------------------------------------

    def deliver_all(self, messages: Sequence[Message]) -> None:
        """Several messages that came in one frame (a forward's commits for its requests), in order."""
        for message in messages:
            self.deliver(message)

    def deliver(self, message: Message) -> None:
        if not isinstance(message, (Commit, Closed, Failed)):  # a stage never sends anything else
            log.error("coordinator: dropped %.200r: not a message a stage sends", message)
            return
        live = self.wires.get(message.request_id)
        if live is None:
            return  # finished, or an incarnation left behind by a rejoin
        if isinstance(message, Commit):
            self._on_commit(live, message)
        elif isinstance(message, Closed):
            if message.stage not in self.stage_names:
                log.error("coordinator: dropped a Closed from an unknown stage %.100r", message.stage)
                return
            live.closed_by[message.stage] = message
            self._complete_if_closed(live)
        elif live.finish_reason is None:  # Failed
            live.error = f"stage {message.stage!r}: {message.error}"
            self._finish(live, "error")

    def lost(self, link: Link) -> None:
        """The link to a stage is gone (the stage died, or the stream broke)."""
        i = next((i for i, known in enumerate(self.stages) if known is link), None)
        if i is None:
            return  # a link already replaced
        self.stages[i] = None
        since = time.monotonic()
        self.lost_at[i] = since
        self.any_lost.set()
        log.warning("coordinator: lost stage %r; %d requests running", self.stage_names[i], len(self.live))
        for live in list(self.live.values()):
            live.opened_on.discard(i)
            self._complete_if_closed(live)
        if i == len(self.stage_names) - 1:  # the target: its requests wait for it, for a while
            asyncio.get_running_loop().call_later(self.restore_s, self._give_up, i, since)

    def restored(self, links: Mapping[int, Link]) -> None:
        """These stages are back, stage i behind links[i]: every running request rejoins (once) from its
        committed prefix."""
        for i, link in links.items():
            self.stages[i] = link
            self.lost_at.pop(i, None)
        if not self.lost_at:
            self.any_lost.clear()
        names = ", ".join(repr(self.stage_names[i]) for i in links)
        log.warning("coordinator: stage %s restored; %d requests rejoin", names, len(self.live))
        for live in list(self.live.values()):
            if live.finish_reason is None:
                old = live.wire
                del self.wires[old]
                for j in live.opened_on:
                    self.stages[j].send(Close(old))
                live.rejoins += 1
                self._open(live, f"{live.spec.request_id}/{live.rejoins}")

    def trouble(self) -> str | None:
        """None while every stage is linked; else which stages are lost, for health checks. A lost
        drafter costs speed only: new requests are still served (see `refusal`)."""
        return "; ".join(self._lost_text(i) for i in sorted(self.lost_at)) or None

    def refusal(self) -> str | None:
        """Why a new request is refused now (the server drains, the target is lost), or None: the one rule
        `generate` and the ways in (pipespec.serving.Serving.refusal) follow."""
        if self.draining is not None:
            return self.draining
        target = len(self.stage_names) - 1
        if target in self.lost_at:
            return f"{self._lost_text(target)}; the pipeline is restoring it"
        return None

    def _lost_text(self, i: int) -> str:
        return f"stage {self.stage_names[i]!r} was lost {time.monotonic() - self.lost_at[i]:.1f} s ago"

    def _give_up(self, i: int, since: float) -> None:
        """The target lost at `since` is still not restored: its requests fail, naming it."""
        if self.lost_at.get(i) != since:
            return
        why = f"stage {self.stage_names[i]!r} was lost and not restored within {self.restore_s:g} s"
        for request_id in list(self.live):
            self.fail(request_id, why)

    def _on_commit(self, live: _Live, commit: Commit) -> None:
        if live.finish_reason is not None:
            return  # the target ran past a stop before hearing of it
        rid = live.spec.request_id
        error = None
        if (live.spec.logprobs is not None or self.learns_top) and len(commit.logprobs or ()) != len(commit.tokens):
            error = f"request {rid!r}: a commit of {len(commit.tokens)} tokens has {len(commit.logprobs or ())} logprobs"
        else:
            try:
                self.ledger.append(rid, commit.start, commit.tokens)
            except LedgerError as e:
                error = str(e)
        if error is not None:
            log.error("%s", error)
            live.error = error
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
        if self.learns_top:
            self._relay(Commit(commit.request_id, commit.start, tuple(ids), commit.logprobs[: len(ids)]))
        asked = live.spec.logprobs  # none past a stop
        logprobs = tuple(_trimmed(lp, asked) for lp in commit.logprobs[: len(ids)]) if asked is not None else ()
        live.queue.put_nowait(Delta("".join(text), tuple(ids), logprobs=logprobs))
        if reason is not None:
            self._finish(live, reason)

    def _relay(self, commit: Commit) -> None:
        """`commit` (what the client gets of it) to the first stage, which learns from it; not if that link is lost.
        A relay that fails costs that stage's drafts, never the request."""
        link = self.stages[0] if self.stages else None
        if link is None:
            return
        try:
            link.send(commit)
        except Exception as error:  # any fault of the link's: logged, the request goes on
            log.warning("request %s: a commit not relayed to %s", commit.request_id, self.stage_names[0], exc_info=error)

    def _finish(self, live: _Live, reason: str) -> None:
        live.finish_reason = reason
        live.finished = time.perf_counter()
        for i in live.opened_on:
            self.stages[i].send(Close(live.wire))
        self._complete_if_closed(live)

    def _complete_if_closed(self, live: _Live) -> None:
        """Complete a finished request once every stage that holds it has closed it."""
        if live.finish_reason is None or any(self.stage_names[i] not in live.closed_by for i in live.opened_on):
            return
        rid = live.spec.request_id
        first = live.first_commit if live.first_commit is not None else live.finished
        order = {name: i for i, name in enumerate(self.stage_names)}
        closed = sorted(live.closed_by.values(), key=lambda c: order[c.stage])  # a lost stage sent none
        stats = RequestStats(
            prompt_tokens=len(live.spec.prompt_token_ids),
            generated_tokens=live.rules.count,  # committed tokens streamed, up to a stop
            prefill_s=first - live.submitted,
            decode_s=live.finished - first,
            pairs=[c.pair_stats for c in closed if c.pair_stats is not None],
            stages=[c.stage_stats for c in closed],
        )
        del self.live[rid], self.wires[live.wire]
        if not self.live:
            self.idle.set()
        self.ledger.close(rid)
        live.queue.put_nowait(Delta("", (), live.finish_reason, stats, live.error))


def _trimmed(logprobs: TokenLogprobs, k: int) -> TokenLogprobs:
    """`logprobs` with its k top alternatives only (the target may send more, for a learner)."""
    if len(logprobs.top_ids) <= k:
        return logprobs
    return dataclasses.replace(logprobs, top_ids=logprobs.top_ids[:k], top_logprobs=logprobs.top_logprobs[:k])
