"""Trials: a plan's best candidates run in place, on a local Ray, and timed as a client sees them.

The chain model (pipespec.planning.analytical) ranks candidates from forwards profiled alone, in one
process. What the runtime delivers differs, and not by one factor that could be measured once:
- on the demo models on 2 cores, a stage's step in its actor cost 1.7x (the target) to 4x (the tiny
  drafter) its forward alone: dispatch and handoff, and the actor's own threads on the same core;
- the target waited for drafts 13% of its time (patience) and verified fewer drafts a step than a
  window;
- a request pays its prefill and the client's stream.

There, the model predicted 3-5x what `pipespec demo` measured, and its pick moved with the profile's
noise. So the plan tries its candidates in place: the `count` chains the model ranks highest, each at
its best placement and lookaheads, and the target alone as the baseline. Each starts as the config
the plan would write (`candidate_config`), is warmed up, then runs `rounds` rounds of the profile's
prompts, greedy (pipespec.cluster.timed_requests: tokens over the seconds of whole requests, as
`pipespec demo` and the bench measure). A trial's rate is the median of its rounds. The recommendation
is the fastest measured, or, within `TRIAL_TIE` of it, the one on fewer devices, then with fewer
stages: runs of one config vary about that much on a shared machine, and a pick that follows the
noise is no pick. Its measured rate is the plan's prediction (`Plan.predicted`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipespec.config import load_config
from pipespec.planning.placement import label

if TYPE_CHECKING:
    from pipespec.planning.plan import Candidate, Plan

log = logging.getLogger(__name__)

TRIALS = 3  # chains tried in place, besides the target alone
ROUNDS = 3  # rounds of the profile's prompts per trial
TRIAL_TIE = 0.10  # a trial within 10% of the fastest, on fewer devices (then stages), is recommended instead


@dataclass(frozen=True)
class Trial:
    """One candidate run in place: its tokens per second in each round."""

    candidate: Candidate
    rounds: tuple[float, ...]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.rounds)

    def __str__(self) -> str:
        return f"{' -> '.join(self.candidate.stages)} on {label(self.candidate.placement)}, {self.tokens_per_s:.1f} tok/s"


def contenders(plan: Plan, count: int = TRIALS) -> list[Candidate]:
    """The recommended candidate and the best of each next chain, fastest predicted first, `count` in all,
    then the target alone (the baseline), unless it is among them."""
    chosen = [plan.recommended]
    for candidate in plan.chains:
        if len(chosen) < count and all(candidate.stages != c.stages for c in chosen):
            chosen.append(candidate)
    alone = next(c for c in plan.chains if len(c.stages) == 1)
    return chosen if alone in chosen else [*chosen, alone]


def run_trials(
    raw: Mapping[str, Any],
    plan: Plan,
    picture: Any = None,
    count: int = TRIALS,
    rounds: int = ROUNDS,
    on_trial: Callable[[Trial], None] | None = None,
) -> tuple[Trial, ...]:
    """Start a local Ray, try each of `contenders(plan, count)` in turn (`picture`: what the profile's
    prompts ask about, for a VLM target; `on_trial` is given each trial as it ends) -> the trials, fastest first."""
    from pipespec.cluster.pipeline import local_ray
    from pipespec.cluster.timed_requests import serving, timed, tokens_per_s
    from pipespec.planning.plan import candidate_config
    from pipespec.planning.profiling import request_keywords

    prof = plan.profile
    raw = {**raw, "server": {**raw.get("server", {}), "port": 0}}  # a trial's coordinator: any free port
    trials = []
    with local_ray():
        for candidate in contenders(plan, count):
            config = load_config(candidate_config(raw, candidate, plan.devices))
            requests = [request_keywords(config, p, picture, prof.max_new_tokens) for p in prof.prompts]
            with serving(config, requests[0]) as client:
                rates = tuple(tokens_per_s([timed(client.stream, r) for r in requests]) for _ in range(rounds))
            log.info("tried %s: %s tok/s", " -> ".join(candidate.stages), " / ".join(f"{r:.1f}" for r in rates))
            trials.append(Trial(candidate, rates))
            if on_trial is not None:
                on_trial(trials[-1])
    return tuple(sorted(trials, key=lambda t: -t.tokens_per_s))


def tried(plan: Plan, trials: Sequence[Trial]) -> Plan:
    """`plan` with its trials, recommending the fastest tried (fewer devices, then stages, within `TRIAL_TIE`)."""
    fastest = max(t.tokens_per_s for t in trials)
    best = min(
        (t for t in trials if t.tokens_per_s >= (1 - TRIAL_TIE) * fastest),
        key=lambda t: (t.candidate.devices, len(t.candidate.stages), -t.tokens_per_s),
    )
    return replace(plan, recommended=best.candidate, trials=tuple(trials))
