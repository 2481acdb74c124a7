"""StageRunner: drives one stage of the asynchronous pipeline (design section 2).

One runner per stage, one asyncio task per runner. The event loop only does bookkeeping on token
ids; each forward is planned here and run, with its choices, on the compute thread of the runner's
device (pipespec.engine.step; pipespec.engine.scheduler: stages placed on one device share it, one forward at a
time), so messages keep arriving while a model runs. Every state change happens on the event loop
(in the handler of one message, or when the device's scheduler launches a step), so there are no
locks. A runner can record where its time goes (`trace`, pipespec.engine.trace).

Per request a runner keeps its generated tokens (committed part + its own speculative tail) and, one
part per role (pipespec.engine.request_state):

- as a verifier of its drafter (upstream): the link epoch and the drafts received but not yet
  verified (`pending`, covering positions len(tokens)..). A draft of an older epoch is dropped on
  arrival; a draft that contradicts a token of ours bumps the epoch ("conflict").
- as a drafter of its verifier (downstream): the verifier's epoch, how many tokens were sent, and how
  many the verifier has confirmed (`verified`), which bounds the lookahead.

A step verifies the pending drafts (or, with none, generates one token itself: a verifier never
idles), then sends a Verdict upstream, a Draft downstream, or a Commit (target). A verdict from
downstream that contradicts our tokens truncates them and bumps our own upstream epoch; a step that
was computing on the old tokens is discarded when it returns (`rev` changed). The KV cache is
truncated lazily: `fed` counts the context tokens in the cache that are still valid, and the next
forward passes it as `keep`.

How a Draft, a Verdict or TargetFeatures changes a request, and how a peer's violation of the
protocol is answered, is the link protocol's (pipespec.engine.link_protocol).

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
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pipespec.config import PipelineConfig
from pipespec.engine.choice import Decision
from pipespec.engine.early_mail import EarlyMail
from pipespec.engine.handoff import prefill_message, step_message
from pipespec.engine.link_protocol import LinkProtocol
from pipespec.engine.outcome_cache import Branch, OutcomeCache
from pipespec.engine.patience import Patience
from pipespec.engine.request_state import NOTHING_TOUCHED, FeatureInbox, RequestState, VerifierSide
from pipespec.engine.scheduler import Batch, DeviceScheduler, Done, Priority
from pipespec.engine.stage import Stage, TreeSession, unfed_tail
from pipespec.engine.step import Outcome, Prefill, Rider, StepPlan, compute
from pipespec.engine.trace import StageTrace
from pipespec.protocol.links import InProcessLink, Link
from pipespec.protocol.messages import Close, Closed, Commit, Draft, Failed, Message, Open, TargetFeatures, Verdict
from pipespec.protocol.stats import PairStats, StageStats
from pipespec.stages.kinds import kind_of

log = logging.getLogger(__name__)


_WAKE = object()  # posted by a timer when a wait for drafts runs out


@dataclass(frozen=True)
class _Lost:
    """Posted when a link is gone, so that it is handled after the messages that came before it."""

    link: Link


class StageRunner(LinkProtocol):
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
    ):
        self.stage = stage
        self.sends_features = sends_features
        self.reads_features = reads_features
        self.name = name
        self.depth = depth
        self.max_lookahead = max_lookahead
        self.drafter_name = drafter_name
        self.drafter_lookahead = drafter_lookahead
        self.verify_window = verify_window
        # every drafter may pre-draft (a middle stage tells its own drafter a branch it took in its verdict)
        self.predraft = predraft if depth > 0 and not sends_features else 0
        self.patience = patience or Patience()
        self.token_s: float | None = None  # our compute seconds per produced token (EMA), told to our verifier
        self.drafter_token_s: float | None = None  # what our drafter last told us of its own
        self.upstream: Link | None = None  # to our drafter
        self.downstream: Link | None = None  # to our verifier
        self.coordinator: Link | None = None
        self.lost_roles: set[str] = set()  # links lost and not replaced: drafter, verifier, coordinator
        self.requests: OrderedDict[str, RequestState] = OrderedDict()
        self.unprefilled: dict[str, None] = {}  # open requests without a session yet, oldest first (what `next_batch` prefills)
        self.early = EarlyMail(name)  # messages that overtook their request's Open
        self.closed: OrderedDict[str, None] = OrderedDict()  # recently closed ids, to drop stragglers
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: list[tuple[Link, Callable[..., Message] | Message, tuple]] = []  # sent after the next poke
        self.scheduler = scheduler or DeviceScheduler(name)
        self.scheduler.join(self)
        self.trace = StageTrace(name)
        self.loop: asyncio.AbstractEventLoop | None = None

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
            scheduler=scheduler,
        )

    # ---- wiring -------------------------------------------------------------------------------

    def deliver(self, message: Message) -> None:
        self.inbox.put_nowait(message)

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
                self._receive(message)
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
        if rid is None or not isinstance(message, (Open, Close, Draft, Verdict, TargetFeatures)):
            log.error("stage %s: dropped %.200r: not a message a stage takes for a request", self.name, message)
            return
        if isinstance(message, (Draft, Verdict, TargetFeatures)) and rid not in self.requests:
            if rid not in self.closed:  # overtook its Open on another link: replay after the Open
                self.early.hold(rid, message)
            return
        if isinstance(message, Draft):
            self._on_draft(message)
        elif isinstance(message, Verdict):
            self._on_verdict(message)
        elif isinstance(message, TargetFeatures):
            self._on_features(message)
        elif isinstance(message, Open):
            self._on_open(message)
        else:
            self._on_close(rid)

    # ---- scheduling (pipespec.engine.scheduler asks; the device's compute thread runs) -------------------

    @property
    def has_mail(self) -> bool:
        """Messages wait in our inbox: our next batch may change once we have read them."""
        return not self.inbox.empty()

    def next_batch(self) -> Batch | None:
        """Our next work (the scheduler may not take it; a wait for drafts may start): a prefill first,
        then a step, round robin. A request whose plan fails is failed, not the runner."""
        if self.unprefilled:
            return Batch(self, (Prefill(next(iter(self.unprefilled))),), Priority.CHECK)
        for rid, req in list(self.requests.items()):
            try:
                plan = self._plan(rid, req)
            except Exception as error:  # a bug or a peer's bad frame in one request must not take down the others
                self._fail(rid, error)
                self.deliver(_WAKE)  # another runner's poke may have asked: our own loop sends the failure
                continue
            if plan is not None:
                return Batch(self, (plan,), self._priority(plan))
        if self.trace.enabled:
            self._trace_idle()
        return None

    def _priority(self, plan: StepPlan) -> Priority:
        """A verification is checked first; a draft next, for the stage that waits on it; a step of the
        target alone or of a pre-drafted branch last (pipespec.engine.scheduler)."""
        if plan.drafts:
            return Priority.CHECK
        return Priority.DRAFT if self.depth > 0 and plan.branch is None else Priority.ALONE

    def launch(self, batch: Batch) -> Callable[[], list[Outcome]]:
        """The device takes `batch`: features are taken now; -> what the compute thread runs."""
        planned = self.trace.planned() if self.trace.enabled else 0.0
        work = []
        for plan in batch.plans:
            req = self.requests[plan.request_id]
            self.requests.move_to_end(plan.request_id)
            if isinstance(plan, StepPlan):
                if req.outcomes is not None:  # the forward writes past plan.keep: no other line holds more
                    req.outcomes.overwritten(plan.keep)
                if plan.branch is not None:
                    req.fed = min(req.fed, plan.keep)
                req.touched = NOTHING_TOUCHED
                if req.up is not None:
                    req.up.wait_until = None  # the wait for drafts, if any, is over
                if req.features is not None:
                    plan = replace(plan, features=req.features.take())
            work.append((plan, req.session, req.spec))
        stage, depth, sends = self.stage, self.depth, self.sends_features
        return lambda: [compute(stage, plan, session, spec, depth, sends, planned) for plan, session, spec in work]

    def wait_for_device(self, batch: Batch) -> None:
        if self.trace.enabled:
            self.trace.idle("device", drafts_pending=batch.urgent)

    def _trace_idle(self) -> None:
        """Why we found no work, for the trace."""
        ups = [req.up for req in self.requests.values() if req.up is not None]
        pending = any(up.pending for up in ups)
        if any(up.wait_until is not None for up in ups):
            self.trace.idle("waiting", pending)
        elif ups:
            self.trace.idle("starved", pending)
        else:
            self.trace.idle("bounded", pending)

    def _limit(self, req: RequestState) -> int:
        """How many generated tokens this stage may hold now."""
        if self.depth == 0:
            return req.spec.max_new_tokens
        if self.downstream is None:  # our verifier is lost: nothing to draft for
            return len(req.tokens)
        return min(req.spec.max_new_tokens, req.down.verified + self.max_lookahead)

    def _plan(self, rid: str, req: RequestState) -> StepPlan | None:
        start = len(req.tokens)
        limit = self._limit(req)
        if start and req.tokens[-1] in req.spec.stop_token_ids:
            return None
        if req.features is not None and not req.features.has_prefill:
            return None
        if start >= limit:  # at our bound: nothing to draft but what we expect the verdict to need
            return self._branch_plan(rid, req) if req.outcomes is not None and self.downstream is not None else None
        feed = unfed_tail(req.session.last_prompt_token, req.prompt_len, req.fed, req.tokens)
        up, drafts, probs = req.up, (), None
        if up is not None:  # a verifier: the drafts it checks in this step (the first stage generates one token)
            room = min(self.verify_window, self.drafter_lookahead, limit - start - 1)
            n = min(len(up.pending), room)
            if self.upstream is not None and self._wait(up, n, room, req.spec.stop_token_ids):
                return None
            drafts = tuple(up.pending[:n])
            probs = torch.stack(up.pending_probs[:n]) if n and req.spec.params.rejection else None
        epoch, riders = up.epoch if up is not None else 0, self._riders(req, req.fed, None)
        return StepPlan(rid, req.rev, epoch, req.fed, feed, start, drafts, probs, doubts=req.outcomes is not None, riders=riders)

    def _branch_plan(self, rid: str, req: RequestState) -> StepPlan | None:
        """A forward that grows a pre-drafted branch (pipespec.engine.outcome_cache); None if none is worth it."""
        prompt_len = req.prompt_len
        while (branch := req.outcomes.to_grow(len(req.tokens), req.down.verified, req.fed, prompt_len)) is not None:
            if (line := self._branch_line(req, branch)) is not None:
                keep = max(branch.fed, min(req.fed, prompt_len + branch.position))
                feed = unfed_tail(req.session.last_prompt_token, prompt_len, keep, line)
                return StepPlan(
                    rid, req.rev, 0, keep, feed, len(line), (), None, branch=branch, riders=self._riders(req, keep, branch)
                )
        return None

    def _riders(self, req: RequestState, keep: int, beside: Branch | None) -> tuple[Rider, ...]:
        """The branches to grow in the same forward as a step of `beside` (None: of the main line) that keeps
        `keep` context tokens, if the session runs tree forwards (pipespec.engine.stage.TreeSession)."""
        if req.outcomes is None or not req.tree or self.downstream is None:
            return ()
        prompt_len, riders = req.prompt_len, []
        apart = len(req.tokens) if beside is None else beside.position  # the step's line leaves the main line there
        for branch in req.outcomes.riders(len(req.tokens), req.down.verified, req.fed, prompt_len, beside):
            if (line := self._branch_line(req, branch)) is not None:  # shared: at most up to where either line parts
                base = min(keep, prompt_len + min(apart, branch.position), prompt_len + len(line) - 1)
                riders.append(Rider(branch, base, unfed_tail(req.session.last_prompt_token, prompt_len, base, line), len(line)))
        return tuple(riders)

    @staticmethod
    def _branch_line(req: RequestState, branch: Branch) -> list[int] | None:
        """`branch`'s generated tokens, the main line's before it; None (and the branch done) once it reached the
        request's end."""
        line = req.tokens[: branch.position] + ([] if branch.token is None else [branch.token]) + branch.tokens
        if len(line) < req.spec.max_new_tokens and not (line and line[-1] in req.spec.stop_token_ids):
            return line
        branch.done = True
        return None

    def _wait(self, up: VerifierSide, pending: int, room: int, stop_token_ids: frozenset[int]) -> bool:
        """True while this request should wait for more drafts instead of stepping now."""
        now = self.loop.time()
        if up.pending and up.pending[-1] in stop_token_ids:
            room = pending  # the drafter has stopped: nothing more is coming
        if up.wait_until is None:
            want, seconds = self.patience.wait_for(pending, room, self.drafter_token_s)
            if seconds <= 0.0:
                return False
            up.wait_until, up.wait_for = now + seconds, want
            self.loop.call_at(up.wait_until, self.deliver, _WAKE)
        return pending < min(up.wait_for, room) and now < up.wait_until  # `launch` ends the wait

    # ---- events -------------------------------------------------------------------------------

    def _on_open(self, message: Open) -> None:
        spec = message.request
        rid = spec.request_id
        if rid in self.requests or rid in self.closed:
            state = "open" if rid in self.requests else "closed"
            log.error("stage %s: dropped an Open for request %s: it is already %s here", self.name, rid, state)
            return
        up = VerifierSide(PairStats(self.drafter_name, self.name)) if self.drafter_name is not None else None
        features = FeatureInbox() if self.reads_features else None
        req = RequestState(spec, StageStats(self.name), up, features)
        self.requests[rid] = req
        self.unprefilled[rid] = None
        if spec.committed:  # a rejoin: the committed tokens are ours already; the first step feeds them
            n = len(spec.committed)
            req.tokens.extend(spec.committed)
            req.probs.extend([None] * n)
            req.probs_kept_from = req.down.sent = req.down.verified = n
            if up is not None:
                up.start = n
        for early in self.early.release(rid):  # an error in one fails this request (`_receive`)
            self._handle(early)

    def _forget(self, rid: str) -> RequestState | None:
        self.early.release(rid)
        self.closed[rid] = None
        self.unprefilled.pop(rid, None)
        if len(self.closed) > 100_000:
            self.closed.popitem(last=False)
        return self.requests.pop(rid, None)

    def _on_close(self, rid: str) -> None:
        req = self._forget(rid)
        if req is None:  # already failed here: still acknowledge, so the coordinator can finish
            self._send(self.coordinator, Closed(rid, self.name, StageStats(self.name), None))
            return
        if req.session is not None:
            self.scheduler.run_later(req.session.close)
        self._send(self.coordinator, Closed(rid, self.name, req.stats, req.up.pair if req.up is not None else None))

    def _on_lost(self, link: Link) -> None:
        """Degrade, don't die (design 5c). Without our drafter we verify alone: no drafts, no waiting.
        Without our verifier we hold our requests (nothing to draft for) until the coordinator
        re-opens them on a restored verifier, or closes them. Without the coordinator our requests
        are orphans: closed here."""
        if link is self.upstream:
            self.upstream, role = None, "drafter"
            for req in self.requests.values():
                req.up.clear_from(len(req.tokens))
                req.up.wait_until = None
        elif link is self.downstream:
            self.downstream, role = None, "verifier"
        elif link is self.coordinator:
            self.coordinator, role = None, "coordinator"
            for rid in list(self.requests):
                req = self._forget(rid)
                if req.session is not None:
                    self.scheduler.run_later(req.session.close)
        else:
            return  # a link already replaced
        self.lost_roles.add(role)
        log.warning("stage %s: lost its %s link; %d requests open here", self.name, role, len(self.requests))

    def _fail(self, rid: str, error: BaseException) -> None:
        log.error("stage %s: request %s failed", self.name, rid, exc_info=error)
        req = self._forget(rid)
        if req is not None and req.session is not None:
            self.scheduler.run_later(req.session.close)
        self._send(self.coordinator, Failed(rid, self.name, f"{type(error).__name__}: {error}"[:_ERROR_CHARS]))

    def _on_done(self, done: Done) -> None:
        self.scheduler.release(self)
        if done.future.cancelled():
            return
        for plan, outcome in zip(done.batch.plans, done.future.result()):
            if plan.request_id in self.requests:
                try:
                    self._take(plan, outcome)
                except Exception as error:  # a bug in one request must not take down the others
                    self._fail(plan.request_id, error)
            elif isinstance(plan, Prefill) and outcome.error is None:  # closed while it prefilled
                self.scheduler.run_later(outcome.result.close)
            if self.trace.enabled and outcome.planned:  # planned 0: launched before the trace began
                self._trace_step(plan, outcome)  # handled now: the result is applied

    def _trace_step(self, plan: StepPlan | Prefill, outcome: Outcome) -> None:
        if isinstance(plan, Prefill):
            self.trace.step("prefill", 0, 0, outcome.planned, outcome.timing)
        elif outcome.error is not None:
            self.trace.step("failed", 0, 0, outcome.planned, outcome.timing)
        else:
            kind = "verify" if plan.drafts else "generate"
            self.trace.step(kind, len(plan.drafts), outcome.result[0].accepted, outcome.planned, outcome.timing)

    def _take(self, plan: StepPlan | Prefill, outcome: Outcome) -> None:
        """Apply one plan's outcome to its request."""
        rid = plan.request_id
        req = self.requests[rid]
        if outcome.error is not None:
            self._fail(rid, outcome.error)
            return
        seconds = outcome.timing.ended - outcome.timing.started
        req.stats.forwards += 1  # every forward with its seconds, the prefill's too: a drafter timed on its prefill
        req.stats.compute_s += seconds  # alone once had a latency of 0
        if isinstance(plan, Prefill):
            req.session = outcome.result
            req.tree = isinstance(req.session, TreeSession)
            if self.predraft:  # branches grown beside our steps reach our bound; one forward a token, half of it
                req.outcomes = OutcomeCache(
                    self.predraft, depth=self.max_lookahead if req.tree else max(1, self.max_lookahead // 2)
                )
            del self.unprefilled[rid]
            req.fed = req.session.prompt_len - 1
            if self.sends_features:
                self._send(self.upstream, prefill_message, rid, req.session.prefill_features)
                req.session.prefill_features = None  # sent: the target itself never needs them
            return
        decision, hidden, grown = outcome.result
        per_token = seconds / len(decision.tokens)
        self.token_s = per_token if self.token_s is None else 0.8 * self.token_s + 0.2 * per_token
        req.stats.tokens_fed += len(plan.feed) + len(plan.drafts)
        self.patience.observe_forward(seconds)
        if plan.branch is not None or plan.riders:
            req.stats.predraft_forwards += 1
        for rider, rode in zip(plan.riders, grown, strict=True):  # a tree forward answers every side
            self._grow(req, plan.rev, rider.branch, rider.start, max(rider.base, rider.branch.fed), rode)  # the forward kept both
        if plan.branch is not None:
            self._grow(req, plan.rev, plan.branch, plan.start, plan.keep + len(plan.feed), decision)
            return
        if plan.rev != req.rev:  # a verdict changed our tokens meanwhile: keep only the valid cache
            # (or what a pre-drafted branch the verdict took holds: the forward wrote past both)
            req.fed = max(req.fed, req.prompt_len + min(plan.start, req.touched))
            return
        self._apply(req, plan, decision, hidden)

    def _grow(self, req: RequestState, rev: int, branch: Branch, start: int, fed: int, decision: Decision) -> None:
        """A forward grew `branch` by the token it decided at `start` (the cache now holds `fed` context tokens of
        the branch's line): the token joins the branch, unless a verdict dropped the branch meanwhile."""
        if rev != req.rev or not req.outcomes.holds(branch):
            return
        token = decision.tokens[0]
        full = token in req.spec.stop_token_ids or start + 1 >= req.spec.max_new_tokens
        prob = decision.probs[0] if decision.probs is not None else None
        req.outcomes.grown(branch, token, prob, fed, full)

    def _apply(self, req: RequestState, plan: StepPlan, decision: Decision, hidden: torch.Tensor | None) -> None:
        tokens = decision.tokens
        for i, t in enumerate(tokens):  # nothing after a stop token
            if t in req.spec.stop_token_ids:
                tokens = tokens[: i + 1]
                break
        req.tokens.extend(tokens)
        req.probs.extend(decision.probs[: len(tokens)] if decision.probs is not None else [None] * len(tokens))
        if decision.logprobs is not None:  # the target's, for the next Commit
            req.logprobs.extend(decision.logprobs[: len(tokens)])
        req.fed = req.prompt_len + min(plan.start + decision.accepted, len(req.tokens) - 1)
        if req.outcomes is not None:
            req.outcomes.decided(plan.start, (decision.doubts or ())[: len(tokens)])
        if req.up is not None:
            req.up.pair.record(len(plan.drafts), decision.accepted)
            self.patience.observe_verification(len(plan.drafts), decision.accepted)
            if plan.up_epoch == req.up.epoch:
                req.up.drop_pending(len(plan.drafts))
        if hidden is not None:  # before the verdict: the fed tokens and the accepted drafts are ours
            accepted = min(decision.accepted, len(tokens))  # none past a stop token
            self._send(self.upstream, step_message, req.spec.request_id, plan.keep, hidden, len(plan.feed), accepted)
        if self.upstream is None and req.up is not None:  # our drafter is lost: nothing pending, none expected
            req.up.clear_from(len(req.tokens))
        elif self.upstream is not None:
            if decision.accepted < len(plan.drafts) and len(tokens) == len(decision.tokens):
                self._conflict(req, len(req.tokens) - 1)  # rejection: our token at plan.start + accepted, our last
            elif (unheard := self._absorb(req)) is not None:
                self._verdict(req, unheard)
        self._publish(req)

    # ---- upstream / downstream ----------------------------------------------------------------

    def _send(self, link: Link | None, message: Callable[..., Message] | Message, *args) -> None:
        """Send `message` (or what `message(*args)` builds: heavy ones are built late) after the next
        poke of the device's scheduler; per link, in order. To a lost link (None), nothing."""
        if link is not None:
            self.outbox.append((link, message, args))

    def _flush(self, only: type | None = None) -> None:
        """Send what waits in the outbox (only on links of type `only`, if given: per link, order stays)."""
        keep = []
        outbox, self.outbox = self.outbox, []
        for entry in outbox:
            link, message, args = entry
            if only is not None and not isinstance(link, only):
                keep.append(entry)
                continue
            try:
                link.send(message(*args) if args else message)
            except Exception as error:  # a message that cannot be built or encoded fails its request only
                rid = args[0] if args else message.request_id
                log.error("stage %s: cannot send for request %s", self.name, rid, exc_info=error)
                if rid in self.requests:
                    self._fail(rid, error)
        self.outbox = keep + self.outbox


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
