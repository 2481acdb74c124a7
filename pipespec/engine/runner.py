"""StageRunner: drives one stage of the asynchronous pipeline (design section 2).

One runner per stage, one asyncio task per runner. The event loop only does bookkeeping on token
ids; each forward is planned here and run, with its choices, on the compute thread of the runner's
device (pipespec.engine.step; pipespec.engine.scheduler: stages placed on one device share it, one forward at a
time), so messages keep arriving while a model runs. Every state change happens on the event loop
(in the handler of one message, or when the device's scheduler launches a step), so there are no
locks. A runner can record where its time goes (`trace`, pipespec.engine.trace).

Per request a runner keeps that request's side of the protocol, a state machine of its own
(pipespec.engine.request_protocol): the runner hands it its neighbours' messages and the outcomes of
its forwards, sends what it says to send over the link to that peer, and asks it for its next forward.
The runner itself holds what its requests share: the links (and tells the requests which it still
has), the device's scheduler, the trace, the outbox, which requests are open, closed or not yet
prefilled, and early mail; it schedules the wake-ups of their waits for drafts. What one turn of its loop
has to send to a peer (one forward's drafts, verdicts or commits for every request it carried) goes as one
delivery (`Link.send_all`: a gRPC frame, cut only at `limits.frame_bytes`). A batching verifier checks, per forward, the drafts that pay for
their rows (pipespec.engine.verify_budget).

Messages that overtake their request's Open are held, within bounds, until it comes (pipespec.engine.early_mail).

A lost link (`lost`: its peer died, or the stream broke) degrades the stage, never stops it
(design 5c): without its drafter a verifier goes on alone; without its verifier a drafter holds its
requests; without the coordinator its requests are closed. A request that rejoins after a restart
opens with its committed tokens (`RequestSpec.committed`), which the first step feeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipespec.config import PipelineConfig
from pipespec.engine.early_mail import EarlyMail
from pipespec.engine.patience import Patience
from pipespec.engine.request_protocol import Peer, RequestProtocol, Role, Surroundings
from pipespec.engine.scheduler import Batch, DeviceScheduler, Done, Priority
from pipespec.engine.stage import AdmittingStage, BatchingStage, CommitLearner, PrefillingSession, Session, Stage, chunk_of
from pipespec.engine.step import Outcome, Prefill, PromptChunk, StepPlan, compute, compute_batch, compute_chunks
from pipespec.engine.trace import StageTrace
from pipespec.engine.verify_budget import EXPLORE_EVERY, Candidate, ForwardCosts, acceptance, verify_counts
from pipespec.protocol.links import InProcessLink, Link
from pipespec.protocol.messages import (
    Close,
    Closed,
    Commit,
    Draft,
    Failed,
    Message,
    Open,
    RequestSpec,
    TargetFeatures,
    Verdict,
)
from pipespec.protocol.stats import StageStats
from pipespec.protocol.tree_shape import TreeShape
from pipespec.schema.kinds import kind_of

log = logging.getLogger(__name__)


_WAKE = object()  # posted by a timer when a wait for drafts runs out


@dataclass
class _Begun:
    """A request whose prompt goes in by chunks: its session, and the compute seconds of its prefill so far."""

    session: PrefillingSession
    seconds: float


@dataclass(frozen=True)
class _Lost:
    """Posted when a link is gone, so that it is handled after the messages that came before it."""

    link: Link


class StageRunner:
    def __init__(
        self,
        stage: Stage,
        *,
        name: str,
        depth: int,  # hops to the target (target = 0)
        max_lookahead: int,
        drafter_name: str | None = None,
        drafter_lookahead: int = 0,
        verify_window: int = 0,
        patience: Patience | None = None,
        scheduler: DeviceScheduler | None = None,  # the device it runs on; None: a device of its own
        sends_features: bool = False,  # our drafter reads our features (a DREAM stage): send them (pipespec.engine.handoff)
        reads_features: bool = False,  # we read our verifier's features (a DREAM stage): step only once the prefill's came
        predraft: int = 0,  # branches pre-drafted per request while we wait (pipespec.engine.outcome_cache); 0: none
        max_batch: int = 1,  # most requests one forward carries, where the stage batches (BatchingStage)
        adaptive_window: bool = True,  # verify only the drafts that pay for their rows (pipespec.engine.verify_budget)
        relay_above: int | None = None,  # a middle stage relays its drafter's drafts unchecked while more requests go on
        offers: TreeShape | None = None,  # we offer our verifier draft trees (our `tree` section)
        drafter_tree: TreeShape | None = None,  # our drafter offers us draft trees (its `tree` section)
    ):
        self.stage = stage
        # what the stage can do, found once (a runtime Protocol's isinstance is dear on the event loop's hot path)
        self.admitting = stage if isinstance(stage, AdmittingStage) else None
        self.learner = stage if isinstance(stage, CommitLearner) else None  # the coordinator relays it commits
        self.takes = (Open, Close, Draft, Verdict, TargetFeatures) + ((Commit,) if self.learner else ())  # per request
        self.max_batch = max_batch if isinstance(stage, BatchingStage) else 1
        # a batching verifier's seconds per batched forward (by requests and rows), which its drafts' rows are weighed against
        self.costs = ForwardCosts() if adaptive_window and drafter_name is not None and isinstance(stage, BatchingStage) else None
        self._weighed = 0  # batched verifications weighed against `costs`
        # every drafter may pre-draft (a middle stage tells its own drafter a branch it took in its verdict)
        predraft = predraft if depth > 0 and not sends_features else 0
        self.role = Role(
            name, depth, max_lookahead, drafter_name, drafter_lookahead, verify_window, sends_features, reads_features, predraft,
            offers if depth > 0 else None, drafter_tree if drafter_name is not None else None,
        )  # fmt: skip
        self.around = Surroundings(patience or Patience())  # what our requests share: our pace, our links
        self.relay_above = relay_above if drafter_name is not None and depth > 0 else None
        self._upstream: Link | None = None  # to our drafter
        self._downstream: Link | None = None  # to our verifier
        self.coordinator: Link | None = None
        self.lost_roles: set[str] = set()  # links lost and not replaced: drafter, verifier, coordinator
        self.requests: OrderedDict[str, RequestProtocol] = OrderedDict()
        self.unprefilled: dict[str, None] = {}  # open requests without a session yet, oldest first (what `next_batch` prefills)
        self.prefilling: dict[str, _Begun] = {}  # begun, their prompts going in by chunks, oldest first
        self._chunks_due = True  # a forward of prompt chunks goes next, if any wait (they alternate with steps)
        self.early = EarlyMail(name)  # messages that overtook their request's Open
        self.closed: OrderedDict[str, None] = OrderedDict()  # recently closed ids, to drop stragglers
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: list[tuple[Link, Callable[..., Message] | Message, tuple]] = []  # sent after the next poke
        self.scheduler = scheduler or DeviceScheduler(name)
        self.scheduler.join(self)
        self.trace = StageTrace(name)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def depth(self) -> int:
        return self.role.depth

    @property
    def drafter_name(self) -> str | None:
        return self.role.drafter_name

    @property
    def upstream(self) -> Link | None:
        """The link to our drafter (None: none, or lost); our requests know whether there is one."""
        return self._upstream

    @upstream.setter
    def upstream(self, link: Link | None) -> None:
        self._upstream = link
        self.around.drafter = link is not None

    @property
    def downstream(self) -> Link | None:
        """The link to our verifier (None: none, or lost); our requests know whether there is one."""
        return self._downstream

    @downstream.setter
    def downstream(self, link: Link | None) -> None:
        self._downstream = link
        self.around.verifier = link is not None

    @classmethod
    def for_config(cls, stage: Stage, config: PipelineConfig, i: int, scheduler: DeviceScheduler | None = None) -> StageRunner:
        """The runner of stage i of `config`, its neighbours' settings included, on `scheduler`'s device."""
        specs = config.stages
        return cls(
            stage,
            name=specs[i].name,
            depth=len(specs) - 1 - i,
            max_lookahead=specs[i].max_lookahead,
            drafter_name=specs[i - 1].name if i else None,
            drafter_lookahead=specs[i - 1].max_lookahead if i else 0,
            verify_window=config.window(i),
            sends_features=config.sends_features(i),
            reads_features=kind_of(specs[i]).reads_target_features,
            predraft=specs[i].predraft,
            max_batch=specs[i].max_batch,
            adaptive_window=specs[i].adaptive_window,
            relay_above=specs[i].relay_above,
            offers=specs[i].tree,
            drafter_tree=specs[i - 1].tree if i else None,
            scheduler=scheduler,
        )

    # ---- wiring -------------------------------------------------------------------------------

    def deliver(self, message: Message) -> None:
        self.inbox.put_nowait(message)

    def deliver_all(self, messages: Sequence[Message]) -> None:
        """Several messages that came together (one frame): read in one turn of the loop, planned from once."""
        self.inbox.put_nowait(tuple(messages))

    def lost(self, link: Link) -> None:
        """`link` is gone (its peer died, or the stream broke): handled in order with the messages before it."""
        self.deliver(_Lost(link))

    def trouble(self) -> str | None:
        """None while this stage can serve; else why not (a link it needs is lost), for health checks."""
        return f"stage {self.name!r} lost its {' and '.join(sorted(self.lost_roles))}" if self.lost_roles else None

    def connect(self, *, upstream: Link | None = None, downstream: Link | None = None, coordinator: Link | None = None) -> None:
        """Give this runner the links given (the others stay): to its drafter (upstream), to its
        verifier (downstream), to the coordinator. Over gRPC each arrives when its stream attaches."""
        if upstream is not None:
            self.upstream = upstream
            self.lost_roles.discard("drafter")
        if downstream is not None:
            self.downstream = downstream
            self.lost_roles.discard("verifier")
        if coordinator is not None:
            self.coordinator = coordinator
            self.lost_roles.discard("coordinator")

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            while True:
                t0 = time.perf_counter() if self.trace.enabled else 0.0
                self._flush(InProcessLink)  # neighbours on this device first: the scheduler plans from their news
                self.scheduler.poke()  # then the next forward starts: other sends are off the device's critical path
                self._flush()
                if self.trace.enabled:
                    self.trace.handled(time.perf_counter() - t0)
                message = await self.inbox.get()
                t0 = time.perf_counter() if self.trace.enabled else 0.0
                for one in message if isinstance(message, tuple) else (message,):
                    self._receive(one)
                if self.trace.enabled:
                    self.trace.handled(time.perf_counter() - t0)
        finally:
            self.scheduler.leave(self)

    def _receive(self, message: Message | Done) -> None:
        """Handle one message; its error fails the request it is about (a message that names none is logged)."""
        try:
            self._handle(message)
        except Exception as error:  # a peer's bad frame or a bug in one request must not take down the others
            rid = _request_id(message)
            if rid is None:
                log.error("stage %s: error handling %.200r", self.name, message, exc_info=error)
            else:
                self._fail(rid, error)

    def _handle(self, message: Message | Done) -> None:
        if message is _WAKE:
            return  # the run loop re-plans after every message
        if isinstance(message, Done):
            self._on_done(message)
            return
        if isinstance(message, _Lost):
            self._on_lost(message.link)
            return
        rid = _request_id(message)
        if rid is None or not isinstance(message, self.takes):
            log.error("stage %s: dropped %.200r: not a message a stage takes for a request", self.name, message)
            return
        if isinstance(message, Open):
            self._on_open(message)
        elif isinstance(message, Close):
            self._on_close(rid)
        elif isinstance(message, Commit):  # the coordinator's, after our Open on the same link
            if (proto := self.requests.get(rid)) is not None:
                self._learn(proto.req.spec, message)
        elif (proto := self.requests.get(rid)) is None:
            if rid not in self.closed:  # overtook its Open on another link: replay after the Open
                self.early.hold(rid, message)
        else:
            try:
                if isinstance(message, Draft):
                    proto.on_draft(message)
                elif isinstance(message, Verdict):
                    proto.on_verdict(message)
                else:
                    proto.on_features(message)
            finally:  # what it said before an error goes out (the request's Failed after it)
                self._route(proto)

    def _learn(self, spec: RequestSpec, commit: Commit) -> None:
        """Our learner learns what the target committed; a fault there costs our drafts' quality, never the request."""
        try:
            self.learner.learn(spec, commit)
        except Exception as error:  # any fault of the learner's: logged, the request goes on
            log.warning("stage %s: learnt nothing of a commit of request %s", self.name, spec.request_id, exc_info=error)

    def _route(self, proto: RequestProtocol) -> None:
        """Send what `proto` says to send, each message on the link to its peer (none once that link is lost)."""
        if not proto.sends:
            return
        links = {Peer.DRAFTER: self.upstream, Peer.VERIFIER: self.downstream, Peer.COORDINATOR: self.coordinator}
        for peer, message, args in proto.sends:
            self._send(links[peer], message, *args)
        proto.sends.clear()

    # ---- scheduling (pipespec.engine.scheduler asks; the device's compute thread runs) -------------------

    @property
    def has_mail(self) -> bool:
        """Messages wait in our inbox: our next batch may change once we have read them."""
        return not self.inbox.empty()

    def next_batch(self) -> Batch | None:
        """Our next work (the scheduler may not take it; a wait for drafts may start): a prefill first (alone) of
        the oldest request the stage has memory for (the others wait, unopened); where prompts go in by chunks
        (pipespec.engine.stage.ChunkedPrefillStage) that prefill only begins the request, and forwards of the begun
        requests' prompt chunks, oldest first, alternate with forwards of steps, so a long prompt delays the
        streams by a chunk at a time. Then the opened requests' steps, round robin: as many requests' steps as one
        forward carries (`max_batch`), the most urgent first (a verification before a draft), the rest filling its
        slots; the batch is as urgent as its most urgent. A request whose plan fails is failed, not the runner.
        A middle stage with more requests going on than its `relay_above` runs no steps (its prefills still run):
        each request passes its drafter's drafts on unchecked (pipespec.engine.request_protocol)."""
        if self.relay_above is not None:  # requests whose tokens end them wait only for their Close
            self.around.relaying = sum(not proto.ended for proto in self.requests.values()) > self.relay_above
        admitted = self._admitted()
        if admitted is not None:
            return Batch(self, (Prefill(admitted),), Priority.CHECK)
        if self.prefilling and self._chunks_due:
            return Batch(self, self._chunks(), Priority.CHECK)
        ready: list[tuple[Priority, StepPlan]] = []
        checks = 0  # verifications among them: a batch of those is full at max_batch
        stepping = len(self.requests) - len(self.unprefilled) - len(self.prefilling)
        self.around.crowded = self.max_batch > 1 and stepping > 1
        relayed = False  # a plan passed drafts on: our loop sends them
        for rid, proto in list(self.requests.items()):
            if rid in self.unprefilled or rid in self.prefilling:  # waiting for memory to be opened, or for its prompt
                continue
            try:
                plan = self._plan(proto)
            except Exception as error:  # a bug or a peer's bad frame in one request must not take down the others
                self._fail(rid, error)
                self.deliver(_WAKE)  # another runner's poke may have asked: our own loop sends the failure
                continue
            if proto.sends:  # it relayed
                self._route(proto)
                relayed = True
            if plan is not None:
                priority = self._priority(plan)
                ready.append((priority, plan))
                checks += priority is Priority.CHECK
                if self.max_batch == 1 or checks >= self.max_batch:
                    break  # one request a forward: the first ready, round robin; or a batch of the most urgent, full
        if relayed:
            self.deliver(_WAKE)  # another runner's poke may have asked: our own loop sends them
        if ready:
            ready.sort(key=lambda entry: entry[0])  # stable: round robin within a kind; the rest fill the slots
            chosen = ready[: self.max_batch]
            return Batch(self, self._budgeted(tuple(plan for _, plan in chosen)), chosen[0][0])
        if self.prefilling:
            return Batch(self, self._chunks(), Priority.CHECK)
        if self.trace.enabled:
            self._trace_idle()
        return None

    def _budgeted(self, plans: tuple[StepPlan, ...]) -> tuple[StepPlan, ...]:
        """`plans` checking only the drafts that pay for their rows in one batched forward
        (pipespec.engine.verify_budget); a request alone checks its window (its forward is another shape)."""
        if self.costs is None or len(plans) == 1 or not self.costs.measured or not any(plan.drafts for plan in plans):
            return plans  # no budget, one request, nothing measured yet, or nothing to weigh
        self._weighed += 1
        if self._weighed % EXPLORE_EVERY == 0:
            return plans  # every draft rides now and then: the cost fit keeps seeing wide forwards
        prior = self.around.patience.acceptance
        candidates = [
            Candidate(
                plan.rows - len(plan.drafts), len(plan.drafts), acceptance(self.requests[plan.request_id].req.up.pair, prior)
            )
            for plan in plans
        ]
        counts = verify_counts(candidates, lambda rows: self.costs.estimate(len(plans), self.stage.forward_rows(rows)))
        return tuple(plan if n == len(plan.drafts) else plan.verifying(n) for plan, n in zip(plans, counts))

    def _chunks(self) -> tuple[PromptChunk, ...]:
        """The begun requests' next prompt chunks for one forward, oldest first: as many as `max_batch` and the
        stage's `prefill_rows` allow in all (the oldest's always)."""
        chunks, rows = [], 0
        for rid, begun in self.prefilling.items():
            rows += chunk_of(self.stage, begun.session)
            if chunks and (rows > self.stage.prefill_rows or len(chunks) == self.max_batch):
                break
            chunks.append(PromptChunk(rid))
        return tuple(chunks)

    def _admitted(self) -> str | None:
        """The oldest request waiting to be opened, once the stage has memory for it (pipespec.engine.stage.AdmittingStage:
        it and those after it wait, in order, for requests to close)."""
        oldest = next(iter(self.unprefilled), None)
        if oldest is None or self.admitting is None:
            return oldest
        return oldest if self.admitting.admits(self.requests[oldest].req.spec) else None  # first come, first served

    def _plan(self, proto: RequestProtocol) -> StepPlan | None:
        """`proto`'s next step, if any; a wait for drafts it begins wakes us when it runs out."""
        try:
            return proto.plan(lambda: self.loop.time())  # read only where a wait needs it
        finally:
            if proto.wake_at is not None:
                self.loop.call_at(proto.wake_at, self.deliver, _WAKE)
                proto.wake_at = None

    def _priority(self, plan: StepPlan) -> Priority:
        """A verification is checked first; a draft next, for the stage that waits on it; a step of the
        target alone or of a pre-drafted branch last (pipespec.engine.scheduler)."""
        if plan.drafts:
            return Priority.CHECK
        return Priority.DRAFT if self.depth > 0 and plan.branch is None else Priority.ALONE

    def launch(self, batch: Batch) -> Callable[[], list[Outcome]]:
        """The device takes `batch`: features are taken now; -> what the compute thread runs."""
        planned = self.trace.planned() if self.trace.enabled else 0.0
        stage, depth, sends = self.stage, self.depth, self.role.sends_features
        if isinstance(batch.plans[0], PromptChunk):
            self._chunks_due = False
            sessions = [self.prefilling[plan.request_id].session for plan in batch.plans]
            return lambda: compute_chunks(stage, sessions, sends, planned)
        self._chunks_due = True
        work = []
        for plan in batch.plans:
            proto = self.requests[plan.request_id]
            self.requests.move_to_end(plan.request_id)
            if isinstance(plan, StepPlan):
                plan = proto.launched(plan)
            work.append((plan, proto.req.session, proto.req.spec))
        if len(work) > 1:  # one forward of the device for them all
            return lambda: compute_batch(stage, work, depth, sends, planned)
        return lambda: [compute(stage, plan, session, spec, depth, sends, planned) for plan, session, spec in work]

    def wait_for_device(self, batch: Batch) -> None:
        if self.trace.enabled:
            self.trace.idle("device", drafts_pending=batch.urgent)

    def _trace_idle(self) -> None:
        """Why we found no work, for the trace."""
        ups = [proto.req.up for proto in self.requests.values() if proto.req.up is not None]
        pending = any(up.pending for up in ups)
        if any(up.wait_until is not None for up in ups):
            self.trace.idle("waiting", pending)
        elif ups:
            self.trace.idle("starved", pending)
        else:
            self.trace.idle("bounded", pending)

    # ---- events -------------------------------------------------------------------------------

    def _on_open(self, message: Open) -> None:
        spec = message.request
        rid = spec.request_id
        if rid in self.requests or rid in self.closed:
            state = "open" if rid in self.requests else "closed"
            log.error("stage %s: dropped an Open for request %s: it is already %s here", self.name, rid, state)
            return
        self.requests[rid] = RequestProtocol(self.role, self.around, spec)
        self.unprefilled[rid] = None
        for early in self.early.release(rid):  # an error in one fails this request (`_receive`)
            self._handle(early)

    def _forget(self, rid: str) -> RequestProtocol | None:
        """Drop request `rid` here (a begun one's session closed); -> its protocol, if it was open."""
        self.early.release(rid)
        if self.learner is not None:
            self.learner.forget(rid)
        self.closed[rid] = None
        self.unprefilled.pop(rid, None)
        if (begun := self.prefilling.pop(rid, None)) is not None:
            self._close_later(begun.session)
        if len(self.closed) > 100_000:
            self.closed.popitem(last=False)
        return self.requests.pop(rid, None)

    def _close_session(self, proto: RequestProtocol | None) -> None:
        if proto is not None and proto.req.session is not None:
            self._close_later(proto.req.session)

    def _close_later(self, session: Session) -> None:
        """Close `session` on the compute thread (after what is queued), then wake our loop: a request waiting
        for memory may fit now. An error closing it is logged: it frees nothing else."""
        loop = self.loop

        def close() -> None:
            try:
                session.close()
            except Exception:
                log.exception("stage %s: closing a session failed", self.name)
            finally:
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(self.deliver, _WAKE)

        self.scheduler.run_later(close)

    def _on_close(self, rid: str) -> None:
        proto = self._forget(rid)
        if proto is None:  # already failed here: still acknowledge, so the coordinator can finish
            self._send(self.coordinator, Closed(rid, self.name, StageStats(self.name), None))
            return
        self._close_session(proto)
        req = proto.req
        if self.admitting is not None:
            req.stats.kv_use = self.admitting.kv_use
        self._send(self.coordinator, Closed(rid, self.name, req.stats, req.up.pair if req.up is not None else None))

    def _on_lost(self, link: Link) -> None:
        """Degrade, don't die (design 5c). Without our drafter we verify alone: no drafts, no waiting.
        Without our verifier we hold our requests (nothing to draft for) until the coordinator
        re-opens them on a restored verifier, or closes them. Without the coordinator our requests
        are orphans: closed here."""
        if link is self.upstream:
            self.upstream, role = None, "drafter"
            for proto in self.requests.values():
                proto.drafter_lost()
        elif link is self.downstream:
            self.downstream, role = None, "verifier"
        elif link is self.coordinator:
            self.coordinator, role = None, "coordinator"
            for rid in list(self.requests):
                self._close_session(self._forget(rid))
        else:
            return  # a link already replaced
        self.lost_roles.add(role)
        log.warning("stage %s: lost its %s link; %d requests open here", self.name, role, len(self.requests))

    def _fail(self, rid: str, error: BaseException) -> None:
        log.error("stage %s: request %s failed", self.name, rid, exc_info=error)
        self._close_session(self._forget(rid))
        self._send(self.coordinator, Failed(rid, self.name, f"{type(error).__name__}: {error}"[:_ERROR_CHARS]))

    def _on_done(self, done: Done) -> None:
        self.scheduler.release(self)
        if done.future.cancelled():
            return
        outcomes = done.future.result()  # one per plan, an error among them (pipespec.engine.step)
        plans = done.batch.plans
        if self.costs is not None and len(plans) > 1 and isinstance(plans[0], StepPlan) and outcomes[0].error is None:
            timing = outcomes[0].timing
            rows = self.stage.forward_rows(sum(plan.rows for plan in plans))
            self.costs.observe(len(plans), rows, timing.ended - timing.started)
        for i, (plan, outcome) in enumerate(zip(done.batch.plans, outcomes)):
            if (proto := self.requests.get(plan.request_id)) is not None:
                try:
                    self._take(proto, plan, outcome, paces=i == 0)
                except Exception as error:  # a bug in one request must not take down the others
                    self._fail(plan.request_id, error)
            elif isinstance(plan, Prefill) and outcome.error is None:  # closed while it prefilled
                self._close_later(outcome.result)  # (a begun request's chunks: closed when it was forgotten)
        if self.trace.enabled and outcomes and outcomes[0].planned:  # planned 0: launched before the trace began
            self._trace_step(done.batch.plans, outcomes)  # handled now: the results are applied

    def _trace_step(self, plans: tuple[StepPlan | Prefill, ...], outcomes: list[Outcome]) -> None:
        """One forward: its kind (a batch's plans share theirs), its drafts and accepted ones over every request it carried."""
        plan, outcome, n = plans[0], outcomes[0], len(plans)
        if isinstance(plan, (Prefill, PromptChunk)):
            self.trace.step("prefill", 0, 0, outcome.planned, outcome.timing, n)
        elif all(o.error is not None for o in outcomes):
            self.trace.step("failed", 0, 0, outcome.planned, outcome.timing, n)
        else:
            done = [(p, o) for p, o in zip(plans, outcomes) if o.error is None]
            drafts = sum(len(p.drafts) for p, _ in done)
            accepted = sum(o.result[0].accepted for _, o in done)
            self.trace.step("verify" if plan.drafts else "generate", drafts, accepted, outcome.planned, outcome.timing, n)

    def _take(self, proto: RequestProtocol, plan: StepPlan | Prefill | PromptChunk, outcome: Outcome, paces: bool = True) -> None:
        """Apply one plan's outcome to its request (`paces`: the first of a forward's, which updates the pace)."""
        if outcome.error is not None:
            self._fail(plan.request_id, outcome.error)
            return
        rid, seconds = plan.request_id, outcome.timing.ended - outcome.timing.started
        try:
            if isinstance(plan, Prefill):
                del self.unprefilled[rid]
                session = outcome.result
                if isinstance(session, PrefillingSession) and session.unfed_prompt:
                    self.prefilling[rid] = _Begun(session, seconds)
                else:
                    proto.prefilled(session, seconds)
            elif isinstance(plan, PromptChunk):
                begun = self.prefilling[rid]
                begun.seconds += seconds
                if outcome.result is not None:  # its prompt is in
                    del self.prefilling[rid]
                    proto.prefilled(begun.session, begun.seconds)
            else:
                proto.finished(plan, outcome, paces)
        finally:
            self._route(proto)

    # ---- sending --------------------------------------------------------------------------------

    def _send(self, link: Link | None, message: Callable[..., Message] | Message, *args) -> None:
        """Send `message` (or what `message(*args)` builds: heavy ones are built late) after the next
        poke of the device's scheduler; per link, in order. To a lost link (None), nothing."""
        if link is not None:
            self.outbox.append((link, message, args))

    def _flush(self, only: type | None = None) -> None:
        """Send what waits in the outbox (only on links of type `only`, if given), each link's as one delivery, in
        order: one forward's messages to a peer travel together, whatever number of requests it carried."""
        keep, by_link = [], {}
        outbox, self.outbox = self.outbox, []
        for entry in outbox:
            link, message, args = entry
            if only is not None and not isinstance(link, only):
                keep.append(entry)
                continue
            try:
                built = message(*args) if args else message
            except Exception as error:  # a message that cannot be built fails its request only
                self._unsent(args[0] if args else message.request_id, error)
                continue
            by_link.setdefault(id(link), (link, []))[1].append(built)
        for link, messages in by_link.values():
            try:
                unsent = link.send_all(messages)  # one that cannot be encoded fails its request only
            except Exception as error:  # a link that fails them all fails their requests, not the runner
                unsent = [(message, error) for message in messages]
            for message, error in unsent:
                self._unsent(message.request_id, error)
        self.outbox = keep + self.outbox

    def _unsent(self, rid: str, error: Exception) -> None:
        log.error("stage %s: cannot send for request %s", self.name, rid, exc_info=error)
        if rid in self.requests:
            self._fail(rid, error)


_ERROR_CHARS = 2000  # of an error sent in `Failed` (its frame stays small: pipespec.protocol.codec)


def _request_id(message: object) -> str | None:
    """The id of the request `message` is about; None if it names none."""
    if isinstance(message, Open):
        rid = message.request.request_id
    elif isinstance(message, (Close, Draft, Verdict, TargetFeatures, Commit, Closed, Failed)):
        rid = message.request_id
    else:
        return None
    return rid if isinstance(rid, str) else None
