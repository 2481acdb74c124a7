"""The link protocol (design section 2): what a Draft, a Verdict or TargetFeatures does to a request.

A `StageRunner` is a `LinkProtocol`: these are its handlers of its neighbours' messages and what it
sends them back, on the state it keeps per request (pipespec.engine.request_state).

- As a verifier of its drafter: a draft of an older epoch is dropped on arrival; drafts extend the
  pending ones; a draft that contradicts a token of ours bumps the epoch and our tokens from there go
  back as a verdict ("conflict").
- As a drafter of its verifier: a verdict confirms what came before its position; where its tokens
  (the verifier's there, then those a branch of the verifier's own supplied) contradict ours, it
  truncates our tokens there and ours become its (a rollback), and if we had already drafted on them,
  our own drafter hears of it in turn, all the tokens it may not hold in one verdict.
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
                    self._conflict(req, position)
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
            branch = req.outcomes.verdict(at, told[at - p], changed)
            if changed:
                self._foreseen(req, branch, told[at - p + 1 :])
        if changed and self.upstream is not None:
            if rollback:
                self._conflict(req, q)
            elif (unheard := self._absorb(req)) is not None:
                self._verdict(req, unheard)
        self._publish(req)

    def _foreseen(self, req: RequestState, branch: Branch | None, after: tuple[int, ...]) -> None:
        """A verdict changed our tokens, and `branch` foresaw it (None: none did), where the verifier also holds
        `after` after its token (from a branch of its own): the branch's tokens past those become ours, with the
        cache entries its forwards wrote, when the two agree; `_publish` sends them on at once. A branch that
        adds nothing past `after` saved nothing: a miss."""
        agrees = branch is not None and branch.tokens[: len(after)] == list(after[: len(branch.tokens)])
        if not agrees or (after and len(branch.tokens) <= len(after)):
            req.stats.predraft_misses += 1
            return
        req.stats.predraft_hits += 1
        req.stats.predraft_tokens += max(0, len(branch.tokens) - len(after))
        req.tokens.extend(branch.tokens[len(after) :])
        req.probs.extend(branch.probs[len(after) :])
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

    def _conflict(self, req: RequestState, start: int) -> None:
        """Our token at `start` contradicts the drafter: new epoch, tell it our tokens from there."""
        req.up.epoch += 1
        req.up.clear_from(len(req.tokens))
        self._verdict(req, start)

    def _absorb(self, req: RequestState) -> int | None:
        """Match pending drafts against tokens we now hold -> the first position of ours the drafter may not hold
        (our last at most: it hears that one again); None if a draft conflicted (`_conflict` told it)."""
        up, known = req.up, len(req.tokens)
        while up.pending and up.start < known:
            if up.pending[0] != req.tokens[up.start]:
                self._conflict(req, up.start)
                return None
            up.drop_pending(1)
        unheard = min(up.start, known - 1)
        if not up.pending:
            up.start = known
        return unheard

    def _verdict(self, req: RequestState, start: int) -> None:
        """Tell our drafter our tokens from `start` on: our last, or all that changed at once (a branch of ours, or
        one of our verifier's, supplied them)."""
        tokens = req.tokens
        self._send(self.upstream, Verdict(req.spec.request_id, req.up.epoch, start, tokens[start], tuple(tokens[start + 1 :])))

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
