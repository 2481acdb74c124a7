"""The link protocol (design section 2): what a Draft, a Verdict or TargetFeatures does to a request.

A `StageRunner` is a `LinkProtocol`: these are its handlers of its neighbours' messages and what it
sends them back, on the state it keeps per request (pipespec.engine.request_state).

- As a verifier of its drafter: a draft of an older epoch is dropped on arrival; drafts extend the
  pending ones; a draft that contradicts a token of ours bumps the epoch and our last token goes
  back as a verdict ("conflict").
- As a drafter of its verifier: a verdict confirms what came before its position; one that
  contradicts our token there truncates our tokens (a rollback), and if we had already drafted on
  them, our own drafter hears of it in turn.
- Either way, what downstream has not seen is published: a Draft to our verifier, or a Commit (target),
  with the logprobs of its tokens when the request asks for them.

A peer's message is checked before it changes anything, and an error fails only the request it is
about, never the runner:

- one that changes nothing we hold is dropped: silently if it is merely late (a draft of an older
  epoch, a message for a closed request), logged if no correct peer sends it (a verdict of an older
  epoch, an Open for a request open or closed here, a message naming no request or of a kind a stage
  does not take); a pace hint that is no number of seconds is ignored, logged;
- any other violation (a draft of an epoch newer than ours, a gap in the drafts, a re-sent draft that
  differs, a verdict beyond our tokens, a Draft or TargetFeatures this stage cannot take) raises
  `ProtocolError` and fails its request (`Failed` to the coordinator): its state may no longer agree
  with its neighbours', so it ends loudly rather than going on in a state no rule was written for.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable

import torch

from pipespec.engine.outcome_cache import Branch
from pipespec.engine.request_state import RequestState
from pipespec.errors import ProtocolError
from pipespec.protocol.links import Link
from pipespec.protocol.messages import Commit, Draft, TargetFeatures, Verdict

log = logging.getLogger(__name__)


class LinkProtocol:
    """The link protocol's handlers; the runner holds the state they read and write."""

    name: str
    depth: int  # hops to the target (target = 0)
    requests: OrderedDict[str, RequestState]
    upstream: Link | None  # to our drafter
    downstream: Link | None  # to our verifier
    coordinator: Link | None
    token_s: float | None
    drafter_token_s: float | None
    _send: Callable[..., None]

    def _on_draft(self, draft: Draft) -> None:
        req = self.requests.get(draft.request_id)
        if req is None:
            return
        up = req.up
        if up is None:
            raise self._violation(draft, "this stage has no drafter")
        if draft.token_s is not None:
            if math.isfinite(draft.token_s) and draft.token_s >= 0.0:
                self.drafter_token_s = draft.token_s
            else:
                self._ignore(draft, f"token_s {draft.token_s} is no pace")
        if draft.epoch < up.epoch:
            req.stats.dropped_drafts += 1
            return
        if draft.epoch > up.epoch:
            raise self._violation(draft, f"epoch {draft.epoch} is newer than ours ({up.epoch})")
        end = up.start + len(up.pending)
        if not 0 <= draft.start <= end:  # drafts are contiguous within an epoch
            raise self._violation(draft, f"start {draft.start} is not within 0..{end}, where our drafts end")
        rows = None if draft.probs is None else len(draft.probs)
        if req.spec.params.rejection and rows != len(draft.tokens):
            raise self._violation(draft, f"probs has {rows} rows for {len(draft.tokens)} tokens (rejection sampling)")
        known = len(req.tokens)
        for i, token in enumerate(draft.tokens):
            position = draft.start + i
            if position < known:  # the drafter had not yet heard of our token there
                if token != req.tokens[position]:
                    self._conflict(req)
                    return
            elif position >= end:
                up.pending.append(token)
                up.pending_probs.append(draft.probs[i] if draft.probs is not None else None)
            elif position >= up.start and up.pending[position - up.start] != token:  # a re-send never differs within an epoch
                held = up.pending[position - up.start]
                raise self._violation(draft, f"tokens[{i}] = {token} at position {position}, where it sent {held} in this epoch")
        if up.start < known and not up.pending:
            up.start = known

    def _on_verdict(self, verdict: Verdict) -> None:
        req = self.requests.get(verdict.request_id)
        if req is None:
            return
        p, t = verdict.position, verdict.token
        length = len(req.tokens)
        down = req.down
        if verdict.epoch < down.epoch:  # verdicts come in order: a correct verifier never sends one
            self._ignore(verdict, f"epoch {verdict.epoch} is older than ours ({down.epoch})")
            return
        if not 0 <= p <= length:
            raise self._violation(verdict, f"position {p} is not within 0..{length}, the length of our tokens")
        rollback = p < length and req.tokens[p] != t
        changed = rollback or p == length
        if changed:
            del req.tokens[p:], req.probs[p:]
            req.tokens.append(t)
            req.probs.append(None)
            req.rev += 1
            req.touched = min(req.touched, p)
            if req.session is not None:
                req.fed = min(req.fed, req.prompt_len + p)
            req.stats.rollbacks += rollback
        down.sent = p + 1 if changed or verdict.epoch > down.epoch else max(down.sent, p + 1)
        down.epoch = verdict.epoch
        down.verified = max(down.verified, p + 1)
        req.probs_kept_from = min(req.probs_kept_from, len(req.probs))
        while req.probs_kept_from <= p:  # a re-send after this verdict starts at p + 1 or later
            req.probs[req.probs_kept_from] = None
            req.probs_kept_from += 1
        if req.outcomes is not None:
            self._foreseen(req, req.outcomes.verdict(p, t, changed), changed)
        if changed and self.upstream is not None:
            if rollback:
                self._conflict(req)
            elif self._absorb(req):
                self._verdict(req)
        self._publish(req)

    def _foreseen(self, req: RequestState, branch: Branch | None, changed: bool) -> None:
        """A verdict changed our tokens (`changed`), and `branch` foresaw it (or none did): its tokens become
        ours, and so do the cache entries its forwards wrote; `_publish` sends them on at once."""
        if not changed:
            return
        if branch is None:
            req.stats.predraft_misses += 1
            return
        req.stats.predraft_hits += 1
        req.stats.predraft_tokens += len(branch.tokens)
        req.tokens.extend(branch.tokens)
        req.probs.extend(branch.probs)
        if req.session is not None:
            req.fed = max(req.fed, branch.fed)

    def _on_features(self, message: TargetFeatures) -> None:
        req = self.requests.get(message.request_id)
        if req is None:
            return
        if req.features is None:
            raise self._violation(message, "this stage reads no target features")
        req.features.add(message)

    def _violation(self, message: Draft | Verdict | TargetFeatures, problem: str) -> ProtocolError:
        return ProtocolError(f"{type(message).__name__} for request {message.request_id!r} at stage {self.name!r}: {problem}")

    def _ignore(self, message: Draft | Verdict, problem: str) -> None:
        log.error("stage %s: ignored %s", self.name, self._violation(message, problem))

    def _conflict(self, req: RequestState) -> None:
        """Our last token contradicts the drafter: new epoch, tell it."""
        req.up.epoch += 1
        req.up.clear_from(len(req.tokens))
        self._verdict(req)

    def _absorb(self, req: RequestState) -> bool:
        """Match pending drafts against tokens we now hold; False if one conflicted."""
        up, known = req.up, len(req.tokens)
        while up.pending and up.start < known:
            if up.pending[0] != req.tokens[up.start]:
                self._conflict(req)
                return False
            up.drop_pending(1)
        if not up.pending:
            up.start = known
        return True

    def _verdict(self, req: RequestState) -> None:
        position = len(req.tokens) - 1
        self._send(self.upstream, Verdict(req.spec.request_id, req.up.epoch, position, req.tokens[position]))

    def _publish(self, req: RequestState) -> None:
        """Send what downstream has not seen: a Draft to our verifier, or a Commit (target)."""
        rid, down, tokens = req.spec.request_id, req.down, req.tokens
        if len(tokens) <= down.sent or (self.depth > 0 and self.downstream is None):
            return  # nothing new, or our verifier is lost
        if self.depth > 0:
            probs = torch.stack(req.probs[down.sent :]) if req.spec.params.rejection else None
            self._send(self.downstream, Draft(rid, down.epoch, down.sent, tuple(tokens[down.sent :]), probs, self.token_s))
        else:
            logprobs = None
            if req.spec.logprobs is not None:  # those of tokens[down.sent:], computed with them (pipespec.engine.step)
                logprobs, req.logprobs = tuple(req.logprobs), []
            self._send(self.coordinator, Commit(rid, down.sent, tuple(tokens[down.sent :]), logprobs))
        down.sent = len(tokens)
