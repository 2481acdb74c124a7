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
its best placement and lookaheads, and the target alone in the runtime (no speculation). Each starts
as the config the plan would write (`candidate_config`), is warmed up, then runs `rounds` rounds of
the profile's prompts, greedy, each round followed by the same prompts to the target alone in this
process, warm (the baseline `pipespec demo` and the bench measure against), timed alike
(pipespec.cluster.timed_requests: tokens over the seconds of whole requests).

A trial's rate is the median of its rounds, its speedup the median of the rounds' ratios. On a shared
machine the rate drifts by a third within minutes (the demo's target alone: 71-108 tok/s over three
runs of `pipespec demo` here) while the ratio of two sides measured side by side holds, so the
recommendation goes by speedup: the greatest, or, within `TRIAL_TIE` of it, the one on fewer devices,
then with fewer stages (a pick that follows the noise is no pick). Its rate and speedup are the plan's
predictions (`Plan.predicted`, `Plan.predicted_speedup`).
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
ROUNDS = 5  # rounds of the profile's prompts per trial: the median of 5 ratios (3 moved by 15% here)
TRIAL_TIE = 0.10  # a trial within 10% of the greatest speedup, on fewer devices (then stages), is recommended instead


@dataclass(frozen=True)
class Trial:
    """One candidate run in place: its tokens per second in each round, and the target alone's in this
    process right after it, in the same round."""

    candidate: Candidate
    rounds: tuple[float, ...]
    alone: tuple[float, ...]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.rounds)

    @property
    def speedup(self) -> float:
        """The median of the rounds' ratios to the target alone: what drifts on a shared machine falls on both sides."""
        return statistics.median(p / a for p, a in zip(self.rounds, self.alone))

    def __str__(self) -> str:
        c = self.candidate
        return f"{' -> '.join(c.stages)} on {label(c.placement)}, {self.tokens_per_s:.1f} tok/s ({self.speedup:.2f}x)"


def contenders(plan: Plan, count: int = TRIALS) -> list[Candidate]:
    """The recommended candidate and the best of each next chain, fastest predicted first, `count` in all,
    then the target alone (no speculation), unless it is among them."""
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
    """Start a local Ray, try each of `contenders(plan, count)` in turn, each round followed by the same
    requests to the target alone in this process, warm, at one device's threads (`picture`: what the
    profile's prompts ask about, for a VLM target; `on_trial` is given each trial as it ends) -> the trials."""
    from pipespec.cluster.pipeline import local_ray
    from pipespec.cluster.timed_requests import serving, timed, tokens_per_s
    from pipespec.local import LocalPipeline
    from pipespec.planning.plan import candidate_config
    from pipespec.planning.profiling import request_keywords, sub_config

    prof = plan.profile
    raw = {**raw, "server": {**raw.get("server", {}), "port": 0}}  # a trial's coordinator: any free port
    target = sub_config(raw, [len(raw["stages"]) - 1])
    requests = [request_keywords(target, p, picture, prof.max_new_tokens) for p in prof.prompts]
    threads = plan.devices.threads if plan.devices else 1
    trials = []
    with local_ray(), LocalPipeline(target, torch_threads=threads) as alone:
        alone.generate(**{**requests[0], "max_new_tokens": 4})
        for candidate in contenders(plan, count):
            config = load_config(candidate_config(raw, candidate, plan.devices))
            measured: list[tuple[float, float]] = []
            with serving(config, requests[0]) as client:
                for _ in range(rounds):
                    pipeline = tokens_per_s([timed(client.stream, r) for r in requests])
                    measured.append((pipeline, tokens_per_s([timed(alone.stream, r) for r in requests])))
            trial = Trial(candidate, *(tuple(side) for side in zip(*measured)))
            log.info("tried %s: %s tok/s", trial, " / ".join(f"{p:.1f} (alone {a:.1f})" for p, a in measured))
            trials.append(trial)
            if on_trial is not None:
                on_trial(trial)
    return tuple(trials)


def tried(plan: Plan, trials: Sequence[Trial]) -> Plan:
    """`plan` with its trials, the greatest speedup first, recommending that one (or, within `TRIAL_TIE`, one
    on fewer devices, then with fewer stages)."""
    trials = sorted(trials, key=lambda t: -t.speedup)
    best = trials[0].speedup
    chosen = min(
        (t for t in trials if t.speedup >= (1 - TRIAL_TIE) * best),
        key=lambda t: (t.candidate.devices, len(t.candidate.stages), -t.speedup),
    )
    return replace(plan, recommended=chosen.candidate, trials=tuple(trials))
