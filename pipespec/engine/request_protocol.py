"""One request's side of the pipeline protocol at one stage, as a state machine (design section 2).

Synchronous and free of I/O: no links, scheduler, trace or asyncio. What goes in: a neighbour's message (`on_draft`,
`on_verdict`, `on_features`), its drafter's loss (`drafter_lost`), the start and the result of a
forward the stage ran for it (`launched`, `prefilled`, `finished`). What comes out: the messages to
send, each addressed to a peer (`sends`: our drafter, our verifier or the coordinator), and the next
forward (`plan`, given a clock; `wake_at`: when a wait for drafts it began runs out). A
`StageRunner` (pipespec.engine.runner) holds one per open request, routes their messages over its
links and gathers their plans for its device. What every request of a stage shares (its settings, its
pace, which neighbours it still has) comes in a `Role` and a `Surroundings`; pre-drafting is behind
the hooks of pipespec.engine.predrafting.

Per request the state keeps its generated tokens (committed part + its own speculative tail) and, one
part per role (pipespec.engine.request_state):

- as a verifier of its drafter (upstream): the link epoch and the drafts received but not yet
  verified (`pending`, covering positions len(tokens)..). A draft of an older epoch is dropped on
  arrival; a draft that contradicts a token of ours bumps the epoch and our tokens from there go back
  as a verdict ("conflict").
- as a drafter of its verifier (downstream): the verifier's epoch, how many tokens were sent, and how
  many the verifier has confirmed (`verified`), which bounds the lookahead. A verdict confirms what
  came before its position; where its tokens (the verifier's there, then those a branch of the
  verifier's own supplied) contradict ours, it truncates our tokens there and ours become its (a
  rollback), and if we had already drafted on them, our own drafter hears of it in turn, all the tokens
  it may not hold in one verdict.

A step verifies the pending drafts (or, with none, generates one token itself: a verifier never
idles), then what downstream has not seen is published: a Draft to our verifier, or a Commit
(target), with the logprobs of its tokens when the request asks for them. A middle stage under load
(`Surroundings.relaying`, its `relay_above`) runs no steps: it takes its drafter's drafts as its own
tokens on arrival, unchecked, and publishes them at its drafter's pace (`_relay`); the target checks
every token, and once the load falls its next step feeds what it relayed. A step that was computing on
tokens a verdict changed meanwhile is discarded when it returns (`rev` changed). The KV cache is
truncated lazily: `fed` counts the context tokens in the cache that are still valid, and the next
forward passes it as `keep`.

A peer's message is checked before it changes anything, and an error fails only the request it is
about (the runner answers it with `Failed`):

- one that changes nothing we hold is dropped: silently if it is merely late (a draft of an older
  epoch), logged if no correct peer sends it (a verdict of an older epoch); a pace hint that is no
  number of seconds is ignored, logged;
- any other violation (a draft of an epoch newer than ours, a gap in the drafts, a re-sent draft that
  differs, a verdict beyond our tokens, a Draft or TargetFeatures this stage cannot take) raises
  `ProtocolError`: the request's state may no longer agree with its neighbours', so it ends loudly
  rather than going on in a state no rule was written for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from pipespec.engine import predrafting
from pipespec.engine.choice import Decision
from pipespec.engine.handoff import prefill_message, step_message
from pipespec.engine.patience import Patience
from pipespec.engine.request_state import NOTHING_TOUCHED, FeatureInbox, RequestState, VerifierSide
from pipespec.engine.stage import Session, TreeSession, unfed_tail
from pipespec.engine.step import Outcome, StepPlan
from pipespec.errors import ProtocolError
from pipespec.protocol.messages import Commit, Draft, Message, RequestSpec, Siblings, TargetFeatures, Verdict
from pipespec.protocol.stats import PairStats, StageStats
from pipespec.protocol.tree_shape import TreeShape

log = logging.getLogger(__name__)


class Peer(Enum):
    """Whom a message goes to: the runner sends it on its link to that peer (none when that link is lost)."""

    DRAFTER = "drafter"
    VERIFIER = "verifier"
    COORDINATOR = "coordinator"


Send = tuple[Peer, Callable[..., Message] | Message, tuple]  # (to whom, a message or what builds it late, its arguments)


@dataclass(frozen=True)
class Role:
    """A stage's settings, as its requests' protocols read them."""

    name: str
    depth: int  # hops to the target (target = 0)
    max_lookahead: int
    drafter_name: str | None = None  # None: the first stage
    drafter_lookahead: int = 0
    verify_window: int = 0
    sends_features: bool = False  # our drafter reads our features (a DREAM stage): send them (pipespec.engine.handoff)
    reads_features: bool = False  # we read our verifier's features (a DREAM stage): step only once the prefill's came
    predraft: int = 0  # branches pre-drafted per request while we wait (pipespec.engine.outcome_cache); 0: none
    offers: TreeShape | None = None  # we offer our verifier trees: our tokens' siblings go with our drafts
    tree: TreeShape | None = None  # our drafter offers trees: we check its line and the best siblings in one forward


@dataclass
class Surroundings:
    """What a stage's requests share: its pace, which their protocols update as forwards and drafts come, and
    which links it still has, which their runner keeps current."""

    patience: Patience = field(default_factory=Patience)
    token_s: float | None = None  # our compute seconds per produced token (EMA), told to our verifier
    drafter_token_s: float | None = None  # what our drafter last told us of its own
    drafter: bool = False  # a link to our drafter
    verifier: bool = False  # a link to our verifier
    # our forwards carry several requests that step now: none waits for drafts (the device would idle for all of
    # them, for drafts their drafter makes in one forward for all of them too)
    crowded: bool = False
    # load sheds this stage's forwards: our drafter's drafts go on to our verifier unchecked (a middle stage's
    # `relay_above`; the target still checks every token)
    relaying: bool = False


class RequestProtocol:
    """One request on one stage: its state (`req`), what it has to send (`sends`), and when to plan again."""

    def __init__(self, role: Role, around: Surroundings, spec: RequestSpec):
        """A request opened on this stage; a rejoin (`spec.committed`) holds its committed tokens already."""
        self.role, self.around = role, around
        up = VerifierSide(PairStats(role.drafter_name, role.name)) if role.drafter_name is not None else None
        self.req = req = RequestState(spec, StageStats(role.name), up, FeatureInbox() if role.reads_features else None)
        self.sends: list[Send] = []  # what to send, in order; the runner takes them after every call
        self.wake_at: float | None = None  # a wait for drafts began: plan again at this time (the runner's clock)
        if spec.committed:  # the first step feeds them
            n = len(spec.committed)
            req.tokens.extend(spec.committed)
            req.probs.extend([None] * n)
            req.probs_kept_from = req.down.sent = req.down.verified = n
            if up is not None:
                up.start = n

    def _send(self, peer: Peer, message: Callable[..., Message] | Message, *args) -> None:
        self.sends.append((peer, message, args))

    @property
    def stopped(self) -> bool:
        """Our last token is a stop token."""
        tokens = self.req.tokens
        return bool(tokens) and tokens[-1] in self.req.spec.stop_token_ids

    @property
    def ended(self) -> bool:
        """Our tokens end the request (a stop token, or max_new_tokens), unless a verdict changes them."""
        return self.stopped or len(self.req.tokens) >= self.req.spec.max_new_tokens

    # ---- the next forward ---------------------------------------------------------------------

    def _limit(self) -> int:
        """How many generated tokens this stage may hold now."""
        req = self.req
        if self.role.depth == 0:
            return req.spec.max_new_tokens
        if not self.around.verifier:  # our verifier is lost: nothing to draft for
            return len(req.tokens)
        return min(req.spec.max_new_tokens, req.down.verified + self.role.max_lookahead)

    def plan(self, clock: Callable[[], float]) -> StepPlan | None:
        """The next step of this request, if it has one now (after its prefill: see `prefilled`); `clock` tells
        the time, when a wait for drafts needs it."""
        req, role = self.req, self.role
        start = len(req.tokens)
        limit = self._limit()
        if self.stopped:
            return None
        if self._relays():  # as on a draft's arrival: no forward, so no features needed
            self._relay()
            return None
        if req.features is not None and not req.features.has_prefill:
            return None
        if start >= limit:  # at our bound: nothing to draft but what we expect the verdict to need
            return predrafting.branch_plan(req) if req.outcomes is not None and self.around.verifier else None
        feed = unfed_tail(req.session.last_prompt_token, req.prompt_len, req.fed, req.tokens)
        up, drafts, probs, siblings, tree_room = req.up, (), None, (), 0
        exact = not req.spec.params.rejection  # trees: greedy and coupled sampling
        if up is not None:  # a verifier: the drafts it checks in this step (the first stage generates one token)
            room = min(role.verify_window, role.drafter_lookahead, limit - start - 1)
            n = min(len(up.pending), room)
            if self.around.drafter and not self.around.crowded and self._wait(clock(), n, room):
                return None
            drafts = tuple(up.pending[:n])
            probs = torch.stack(up.pending_probs[:n]) if n and req.spec.params.rejection else None
            if role.tree is not None and exact:  # the best of their siblings too, as leaves: within the tree's budget
                # (its forward holds our fed tokens and the nodes in budget + 1 rows; a rejoin's first step feeds more)
                siblings, tree_room = tuple(up.pending_siblings[:n]), role.tree.budget + 1 - len(feed) - n
        epoch = up.epoch if up is not None else 0
        riders = predrafting.riders(req, req.fed, None, verifier=self.around.verifier)
        return StepPlan(
            req.spec.request_id, req.rev, epoch, req.fed, feed, start, drafts, probs, doubts=req.outcomes is not None,
            riders=riders, offers=role.offers if exact else None, siblings=siblings, room=max(0, tree_room),
        )  # fmt: skip

    def _wait(self, now: float, pending: int, room: int) -> bool:
        """True while this request should wait for more drafts instead of stepping now."""
        up = self.req.up
        if up.pending and up.pending[-1] in self.req.spec.stop_token_ids:
            room = pending  # the drafter has stopped: nothing more is coming
        if up.wait_until is None:
            want, seconds = self.around.patience.wait_for(pending, room, self.around.drafter_token_s)
            if seconds <= 0.0:
                return False
            up.wait_until, up.wait_for = now + seconds, want
            self.wake_at = up.wait_until
        return pending < min(up.wait_for, room) and now < up.wait_until  # `launched` ends the wait

    def _relays(self) -> bool:
        """Our drafter's drafts go on unchecked: load sheds this stage's forwards, and both neighbours are there."""
        around = self.around
        return around.relaying and around.drafter and around.verifier and self.req.outcomes is None

    def _relay(self) -> None:
        """Pass the pending drafts within our bound on to our verifier as ours, without a forward; our drafter hears
        them confirmed and drafts on. They carry the drafter's probabilities, what our verifier's rejection sampling
        checks them against; a rejection comes back as a verdict, as for any token of ours. A forward in flight for
        the request is dropped when it returns (`rev`): our tokens grew past what it computed on."""
        req, up = self.req, self.req.up
        room = max(0, self._limit() - len(req.tokens))  # our bound
        drafts = _through_stop(up.pending[:room], req.spec.stop_token_ids)
        if not drafts or self.stopped:
            return
        n = len(drafts)
        req.tokens.extend(drafts)
        req.probs.extend(up.pending_probs[:n])
        up.drop_pending(n)
        req.rev += 1
        req.stats.relayed_drafts += n
        self._verdict(len(req.tokens) - 1)
        self._publish()

    def launched(self, plan: StepPlan) -> StepPlan:
        """The device takes `plan`: the wait for drafts, if any, is over; -> the plan with the features taken now."""
        req = self.req
        predrafting.launched(req, plan)
        req.touched = NOTHING_TOUCHED
        if req.up is not None:
            req.up.wait_until = None
        if req.features is not None:
            plan = replace(plan, features=req.features.take())
        return plan

    # ---- what a forward returned ----------------------------------------------------------------

    def prefilled(self, session: Session, seconds: float) -> None:
        """The prompt is in `session`'s cache: the request may step."""
        req, role = self.req, self.role
        req.stats.forwards += 1  # a drafter timed on its prefill once had a latency of 0
        req.stats.compute_s += seconds
        req.session = session
        req.tree = isinstance(session, TreeSession)
        if role.predraft:
            req.outcomes = predrafting.cache(role.predraft, role.max_lookahead, req.tree)
        req.fed = session.prompt_len - 1
        if role.sends_features:
            self._send(Peer.DRAFTER, prefill_message, req.spec.request_id, session.prefill_features)
            session.prefill_features = None  # sent: the target itself never needs them

    def finished(self, plan: StepPlan, outcome: Outcome, paces: bool = True) -> None:
        """Apply a step's outcome (no error) to the request; `paces`: its forward updates the stage's pace (once a
        forward: the first of the requests a batch carried)."""
        req, around = self.req, self.around
        seconds = outcome.timing.ended - outcome.timing.started
        req.stats.forwards += 1
        req.stats.compute_s += seconds  # the forward's, however many requests it carried
        decision, hidden, grown = outcome.result
        if paces:
            per_token = seconds / len(decision.tokens)
            around.token_s = per_token if around.token_s is None else 0.8 * around.token_s + 0.2 * per_token
            around.patience.observe_forward(seconds)
        req.stats.tokens_fed += len(plan.feed) + plan.drafted
        if predrafting.grown(req, plan, decision, grown):
            return  # a forward of a branch: the main line is as it was
        if plan.rev != req.rev:  # a verdict changed our tokens meanwhile: keep only the valid cache
            # (or what a pre-drafted branch the verdict took holds: the forward wrote past both)
            req.fed = max(req.fed, req.prompt_len + min(plan.start, req.touched))
            return
        self._apply(plan, decision, hidden)

    def _apply(self, plan: StepPlan, decision: Decision, hidden: torch.Tensor | None) -> None:
        req = self.req
        tokens = _through_stop(decision.tokens, req.spec.stop_token_ids)
        req.tokens.extend(tokens)
        req.probs.extend(decision.probs[: len(tokens)] if decision.probs is not None else [None] * len(tokens))
        if decision.logprobs is not None:  # the target's, for the next Commit
            req.logprobs.extend(decision.logprobs[: len(tokens)])
        req.fed = req.prompt_len + min(plan.start + decision.accepted, len(req.tokens) - 1)
        if req.outcomes is not None:
            req.outcomes.decided(plan.start, (decision.doubts or ())[: len(tokens)])
        for i, sib in enumerate((decision.siblings or ())[: len(tokens)]):
            req.siblings[plan.start + i] = sib
        if req.up is not None:
            tree = plan.tree  # a path off the line rejected the draft it left: the drafter's line was not accepted whole
            rejected = decision.line < len(plan.drafts)
            req.up.pair.record(len(plan.drafts), decision.accepted, None if tree is None else len(tree), rejected)
            self.around.patience.observe_verification(len(plan.drafts), decision.accepted)
            if plan.up_epoch == req.up.epoch:
                req.up.drop_pending(len(plan.drafts))
        if hidden is not None:  # before the verdict: the fed tokens and the accepted drafts are ours
            accepted = min(decision.accepted, len(tokens))  # none past a stop token
            self._send(Peer.DRAFTER, step_message, req.spec.request_id, plan.keep, hidden, len(plan.feed), accepted)
        if not self.around.drafter and req.up is not None:  # our drafter is lost: nothing pending, none expected
            req.up.clear_from(len(req.tokens))
        elif self.around.drafter:
            if decision.line < min(len(plan.drafts), len(tokens)):  # a draft rejected, and no stop token before it
                self._conflict(plan.start + decision.line)  # a chain's: our last token; a tree's: where its path left the line
            elif (unheard := self._absorb()) is not None:
                self._verdict(unheard)
        self._publish()

    # ---- our neighbours' messages ---------------------------------------------------------------

    def drafter_lost(self) -> None:
        """Without our drafter we verify alone: no drafts pending, none waited for."""
        self.req.up.clear_from(len(self.req.tokens))
        self.req.up.wait_until = None

    def on_draft(self, draft: Draft) -> None:
        req = self.req
        up = req.up
        if up is None:
            raise self._violation(draft, "this stage has no drafter")
        if draft.epoch > up.epoch:
            raise self._violation(draft, f"epoch {draft.epoch} is newer than ours ({up.epoch})")
        if draft.token_s is not None:  # a late draft's pace is as good as any
            if math.isfinite(draft.token_s) and draft.token_s >= 0.0:
                self.around.drafter_token_s = draft.token_s
            else:
                self._ignore(draft, f"token_s {draft.token_s} is no pace")
        if draft.epoch < up.epoch:
            req.stats.dropped_drafts += 1
            return
        end = up.start + len(up.pending)
        if not 0 <= draft.start <= end:  # drafts are contiguous within an epoch
            raise self._violation(draft, f"start {draft.start} is not within 0..{end}, where our drafts end")
        rows = None if draft.probs is None else len(draft.probs)
        if req.spec.params.rejection and rows != len(draft.tokens):
            raise self._violation(draft, f"probs has {rows} rows for {len(draft.tokens)} tokens (rejection sampling)")
        if draft.siblings and len(draft.siblings) != len(draft.tokens):
            raise self._violation(draft, f"it offers siblings at {len(draft.siblings)} positions for {len(draft.tokens)} tokens")
        known = len(req.tokens)
        for i, token in enumerate(draft.tokens):
            position = draft.start + i
            if position < known:  # the drafter had not yet heard of our token there
                if token != req.tokens[position]:
                    self._conflict(position)
                    return
            elif position >= end:
                up.pending.append(token)
                up.pending_probs.append(draft.probs[i] if draft.probs is not None else None)
                up.pending_siblings.append(draft.siblings[i] if draft.siblings else None)
            elif position >= up.start and up.pending[position - up.start] != token:  # a re-send never differs within an epoch
                held = up.pending[position - up.start]
                raise self._violation(draft, f"tokens[{i}] = {token} at position {position}, where it sent {held} in this epoch")
        if up.start < known and not up.pending:
            up.start = known
        if self._relays():
            self._relay()

    def on_verdict(self, verdict: Verdict) -> None:
        req = self.req
        p, told = verdict.position, (verdict.token, *verdict.after)  # the verifier's tokens at p..
        length, end = len(req.tokens), p + len(told)
        down = req.down
        if verdict.epoch < down.epoch:  # verdicts come in order: a correct verifier never sends one
            self._ignore(verdict, f"epoch {verdict.epoch} is older than ours ({down.epoch})")
            return
        if not 0 <= p <= length:
            raise self._violation(verdict, f"position {p} is not within 0..{length}, the length of our tokens")
        if end > req.spec.max_new_tokens:
            raise self._violation(
                verdict, f"its tokens reach position {end - 1}, past max_new_tokens ({req.spec.max_new_tokens})"
            )
        stop = next((i for i, t in enumerate(told[:-1]) if t in req.spec.stop_token_ids), None)
        if stop is not None:
            raise self._violation(verdict, f"its tokens go on after the stop token {told[stop]} at position {p + stop}")
        # the first position where the verifier's tokens are not ours (none: it confirms them all)
        q = next((p + i for i, t in enumerate(told) if p + i >= length or req.tokens[p + i] != t), None)
        changed, rollback = q is not None, q is not None and q < length
        if changed:
            del req.tokens[q:], req.probs[q:]
            for position in [k for k in req.siblings if k >= q]:
                del req.siblings[position]
            req.tokens.extend(told[q - p :])
            req.probs.extend([None] * (end - q))
            req.rev += 1
            req.touched = min(req.touched, q)
            if req.session is not None:
                req.fed = min(req.fed, req.prompt_len + q)
            req.stats.rollbacks += rollback
        down.sent = end if changed or verdict.epoch > down.epoch else max(down.sent, end)
        down.epoch = verdict.epoch
        down.verified = max(down.verified, end)
        req.probs_kept_from = min(req.probs_kept_from, len(req.probs))
        while req.probs_kept_from < end:  # a re-send after this verdict starts at `end` or later
            req.probs[req.probs_kept_from] = None
            req.probs_kept_from += 1
        if req.outcomes is not None:
            at = end - 1 if q is None else q
            predrafting.verdict(req, at, told[at - p], changed, told[at - p + 1 :])
        if changed and self.around.drafter:
            if rollback:
                self._conflict(q)
            elif (unheard := self._absorb()) is not None:
                self._verdict(unheard)
        self._publish()
        if self._relays():  # our bound moved on
            self._relay()

    def on_features(self, message: TargetFeatures) -> None:
        if self.req.features is None:
            raise self._violation(message, "this stage reads no target features")
        self.req.features.add(message)

    def _violation(self, message: Draft | Verdict | TargetFeatures, problem: str) -> ProtocolError:
        return ProtocolError(
            f"{type(message).__name__} for request {message.request_id!r} at stage {self.role.name!r}: {problem}"
        )

    def _ignore(self, message: Draft | Verdict, problem: str) -> None:
        log.error("stage %s: ignored %s", self.role.name, self._violation(message, problem))

    # ---- what we tell our neighbours --------------------------------------------------------------

    def _conflict(self, start: int) -> None:
        """Our token at `start` contradicts the drafter: new epoch, tell it our tokens from there."""
        up = self.req.up
        up.epoch += 1
        up.clear_from(len(self.req.tokens))
        self._verdict(start)

    def _absorb(self) -> int | None:
        """Match pending drafts against tokens we now hold -> the first position of ours the drafter may not hold
        (our last at most: it hears that one again); None if a draft conflicted (`_conflict` told it)."""
        req = self.req
        up, known = req.up, len(req.tokens)
        while up.pending and up.start < known:
            if up.pending[0] != req.tokens[up.start]:
                self._conflict(up.start)
                return None
            up.drop_pending(1)
        unheard = min(up.start, known - 1)
        if not up.pending:
            up.start = known
        return unheard

    def _verdict(self, start: int) -> None:
        """Tell our drafter our tokens from `start` on: our last, or all that changed at once (a branch of ours, or
        one of our verifier's, supplied them)."""
        req, tokens = self.req, self.req.tokens
        self._send(Peer.DRAFTER, Verdict(req.spec.request_id, req.up.epoch, start, tokens[start], tuple(tokens[start + 1 :])))

    def _publish(self) -> None:
        """Send what downstream has not seen: a Draft to our verifier, or a Commit (target)."""
        req = self.req
        rid, down, tokens = req.spec.request_id, req.down, req.tokens
        if len(tokens) <= down.sent or (self.role.depth > 0 and not self.around.verifier):
            return  # nothing new, or our verifier is lost
        if self.role.depth > 0:
            probs = torch.stack(req.probs[down.sent :]) if req.spec.params.rejection else None
            pace = self.around.drafter_token_s if self._relays() else self.around.token_s  # whose tokens come next
            siblings = self._siblings(down.sent, len(tokens))
            self._send(Peer.VERIFIER, Draft(rid, down.epoch, down.sent, tuple(tokens[down.sent :]), probs, pace, siblings))
        else:
            logprobs = None
            if req.spec.logprobs is not None:  # those of tokens[down.sent:], computed with them (pipespec.engine.step)
                logprobs, req.logprobs = tuple(req.logprobs), []
            self._send(Peer.COORDINATOR, Commit(rid, down.sent, tuple(tokens[down.sent :]), logprobs))
        down.sent = len(tokens)

    def _siblings(self, start: int, end: int) -> tuple[Siblings, ...]:
        """The siblings we offer beside our tokens at start..end (none where we know of none: a relayed draft's),
        those the verifier has confirmed dropped; none at all if we offer no trees or know of none there."""
        req = self.req
        for position in [k for k in req.siblings if k < req.down.verified]:
            del req.siblings[position]
        if self.role.offers is None or not any(k in req.siblings for k in range(start, end)):
            return ()
        return tuple(req.siblings.get(k, UNKNOWN) for k in range(start, end))


UNKNOWN = Siblings(0.0)  # beside a token we offer no siblings for: none, the token's value unknown (sure, as far as we say)


def _through_stop(tokens: Sequence[int], stops: Container[int]) -> Sequence[int]:
    """`tokens` up to its first stop token, that one included (nothing after a stop token)."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in stops), tokens)
