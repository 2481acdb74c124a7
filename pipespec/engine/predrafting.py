"""Pre-drafting as one request's protocol uses it: the hooks that plan, grow and cash a drafter's branches.

What a branch is and which ones are worth growing is the outcome cache's (pipespec.engine.outcome_cache).
These are the few places where a request's protocol (pipespec.engine.request_protocol) meets it, each on
the request's state (`req.outcomes` is its cache; None: it does not pre-draft):

- `cache`: a request's cache, once its prefill tells whether its session grows branches beside its steps;
- `branch_plan`: at its lookahead bound, a forward that grows a branch (one forward a token; only while it has
  a verifier to draft for);
- `riders`: the branches a step grows beside its own line in one tree forward (pipespec.engine.stage.TreeSession);
- `launched`: a forward that keeps `keep` cache entries overwrites every other line's past them;
- `grown`: a forward's tokens join the branches it grew;
- `verdict`: a verdict one of them foresaw makes the branch's tokens, and its cache entries, ours.
"""

from __future__ import annotations

from pipespec.engine.choice import Decision
from pipespec.engine.outcome_cache import Branch, OutcomeCache
from pipespec.engine.request_state import RequestState
from pipespec.engine.stage import unfed_tail
from pipespec.engine.step import Rider, StepPlan


def cache(branches: int, max_lookahead: int, tree: bool) -> OutcomeCache:
    """Branches grown beside our steps reach our bound; grown one forward a token, half of it."""
    return OutcomeCache(branches, depth=max_lookahead if tree else max(1, max_lookahead // 2))


def branch_plan(req: RequestState) -> StepPlan | None:
    """A forward that grows a pre-drafted branch; None if none is worth it."""
    prompt_len = req.prompt_len
    while (branch := req.outcomes.to_grow(len(req.tokens), req.down.verified, req.fed, prompt_len)) is not None:
        if (line := _line(req, branch)) is not None:
            keep = max(branch.fed, min(req.fed, prompt_len + branch.position))
            feed = unfed_tail(req.session.last_prompt_token, prompt_len, keep, line)
            rid = req.spec.request_id
            return StepPlan(
                rid, req.rev, 0, keep, feed, len(line), (), None, branch=branch, riders=riders(req, keep, branch, verifier=True)
            )
    return None


def riders(req: RequestState, keep: int, beside: Branch | None, *, verifier: bool) -> tuple[Rider, ...]:
    """The branches to grow in the same forward as a step of `beside` (None: of the main line) that keeps
    `keep` context tokens, if the session runs tree forwards and we have a verifier to draft for."""
    if req.outcomes is None or not req.tree or not verifier:
        return ()
    prompt_len, out = req.prompt_len, []
    apart = len(req.tokens) if beside is None else beside.position  # the step's line leaves the main line there
    for branch in req.outcomes.riders(len(req.tokens), req.down.verified, req.fed, prompt_len, beside):
        if (line := _line(req, branch)) is not None:  # shared: at most up to where either line parts
            base = min(keep, prompt_len + min(apart, branch.position), prompt_len + len(line) - 1)
            out.append(Rider(branch, base, unfed_tail(req.session.last_prompt_token, prompt_len, base, line), len(line)))
    return tuple(out)


def _line(req: RequestState, branch: Branch) -> list[int] | None:
    """`branch`'s generated tokens, the main line's before it; None (and the branch done) once it reached the
    request's end."""
    line = req.tokens[: branch.position] + ([] if branch.token is None else [branch.token]) + branch.tokens
    if len(line) < req.spec.max_new_tokens and not (line and line[-1] in req.spec.stop_token_ids):
        return line
    branch.done = True
    return None


def launched(req: RequestState, plan: StepPlan) -> None:
    """The forward writes past `plan.keep`: no other line holds more; a branch's forward leaves the main line's
    cache valid up to where they share it."""
    if req.outcomes is not None:
        req.outcomes.overwritten(plan.keep)
    if plan.branch is not None:
        req.fed = min(req.fed, plan.keep)


def grown(req: RequestState, plan: StepPlan, decision: Decision, rode: tuple[Decision, ...]) -> bool:
    """The forward's tokens join the branches it grew (`rode`: one decision per rider); -> whether it was a
    forward of a branch (its decision is the branch's, not the main line's)."""
    if plan.branch is not None or plan.riders:
        req.stats.predraft_forwards += 1
    for rider, decided in zip(plan.riders, rode, strict=True):  # a tree forward answers every side
        _grow(req, plan.rev, rider.branch, rider.start, max(rider.base, rider.branch.fed), decided)  # the forward kept both
    if plan.branch is None:
        return False
    _grow(req, plan.rev, plan.branch, plan.start, plan.keep + len(plan.feed), decision)
    return True


def _grow(req: RequestState, rev: int, branch: Branch, start: int, fed: int, decision: Decision) -> None:
    """A forward grew `branch` by the token it decided at `start` (the cache now holds `fed` context tokens of
    the branch's line): the token joins the branch, unless a verdict dropped the branch meanwhile."""
    if rev != req.rev or not req.outcomes.holds(branch):
        return
    token = decision.tokens[0]
    full = token in req.spec.stop_token_ids or start + 1 >= req.spec.max_new_tokens
    prob = decision.probs[0] if decision.probs is not None else None
    req.outcomes.grown(branch, token, prob, fed, full)


def verdict(req: RequestState, at: int, token: int, changed: bool, after: tuple[int, ...]) -> None:
    """A verdict put the verifier's `token` at `at` (changing our tokens, or confirming them all), where it also
    holds `after` after it (from a branch of its own). If it changed them and a branch of ours foresaw it, the
    branch's tokens past `after` become ours, with the cache entries its forwards wrote, when the two agree; the
    protocol then publishes them at once. A branch that adds nothing past `after` saved nothing: a miss."""
    branch = req.outcomes.verdict(at, token, changed)
    if not changed:
        return
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
