"""Trials: a plan's contenders run in place, on a local Ray, each round timed beside the target alone.

The chain model (pipespec.planning.analytical) ranks candidates from forwards profiled alone, in one
process. What the runtime delivers differs, and not by one factor that could be measured once:
- a stage's step in its actor costs more than its forward alone: dispatch and handoff, and the actor's own
  threads on the same cores;
- the target waits for drafts (pipespec.engine.patience) and verifies fewer drafts a step than a window, and
  its forward is slower beside a busy drafter than alone (the bench's traces);
- a request pays its prefill and the client's stream.

So `pipespec plan` and `pipespec demo` try the plan's contenders (pipespec.planning.plan.contenders:
the fastest predicted on each number of devices, each drafter's pair with the target while there is room,
the next best-ranked chains, each at its best placement and lookaheads there, and the target alone in the
runtime), then the chain of greatest speedup among them again with draft trees (pipespec.planning.plan.with_trees:
whether the drafter right before the target offering siblings pays is measured, not predicted). Each starts on a local Ray as the config the plan would write (`candidate_config`, its
coordinator on a free loopback port), is warmed up, then runs `rounds` rounds of the profile's prompts,
greedy, each round followed by the same prompts to the target alone in this process, warm, at one
device's threads and pinned to as many cores, as the actors are (pipespec.engine.affinity.pinned; the
baseline `pipespec demo` measures against), both timed as a client sees them
(pipespec.cli.timed_requests: tokens over the seconds of whole requests).

A trial's speedup is the median of its rounds' ratios: on a shared machine the rate drifts within minutes while
the ratio of two sides measured side by side holds (experiments/results/plan/repeats.md);
`pipespec.planning.plan.tried` picks by it. Every trial starts its own actors, one after the other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipespec.config import PipelineConfig
    from pipespec.planning.plan import Plan, Trial

log = logging.getLogger(__name__)

TRIALS = 3  # chains tried in place, besides the target alone
ROUNDS = 5  # rounds of the profile's prompts per trial: the median of their ratios


def run_trials(
    config: PipelineConfig,
    plan: Plan,
    picture: Any = None,
    count: int = TRIALS,
    rounds: int = ROUNDS,
    max_new_tokens: int | None = None,
    threads: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> tuple[Trial, ...]:
    """Start a local Ray (stopped on return) and try each of `plan`'s contenders in turn, then the chain of greatest
    speedup measured again with draft trees (`with_trees`): `config` the config it planned, `picture` what its prompts
    ask about (a VLM target), `max_new_tokens` each request's (default: the profile's), `threads` the target alone's
    torch threads (default: one device's, else 1); `on_trial` is given each trial as it ends -> the trials. A
    candidate that fails to start raises."""
    from pipespec.cli.timed_requests import serving, timed, tokens_per_s
    from pipespec.cluster.pipeline import local_ray
    from pipespec.config import sub_pipeline
    from pipespec.engine.affinity import pinned
    from pipespec.local import LocalPipeline
    from pipespec.planning.plan import Candidate, Trial, candidate_config, contenders, with_trees
    from pipespec.planning.profiling import request_keywords

    prof = plan.profile
    config = replace(config, server=replace(config.server, host="127.0.0.1", port=0))  # private, any free port
    target = sub_pipeline(config, [config.target.name])
    tokens = max_new_tokens or prof.max_new_tokens
    requests = [request_keywords(target, p, picture, tokens) for p in prof.prompts]
    threads = threads or (plan.devices.threads if plan.devices else 1)
    trials: list[Trial] = []
    with local_ray(), LocalPipeline(target, torch_threads=threads) as alone:
        alone.generate(**{**requests[0], "max_new_tokens": 4})

        def attempt(candidate: Candidate) -> None:
            measured: list[tuple[float, float]] = []
            with serving(candidate_config(config, candidate, plan.devices), requests[0]) as client:
                for _ in range(rounds):
                    pipeline = tokens_per_s([timed(client.stream, r) for r in requests])
                    with pinned(threads):  # as the candidate's actors are (pipespec.cluster.cores)
                        measured.append((pipeline, tokens_per_s([timed(alone.stream, r) for r in requests])))
            trial = Trial(candidate, *(tuple(side) for side in zip(*measured)))
            log.info("tried %s: %s tok/s", trial, " / ".join(f"{p:.1f} (alone {a:.1f})" for p, a in measured))
            trials.append(trial)
            if on_trial is not None:
                on_trial(trial)

        for candidate in contenders(plan, count):
            attempt(candidate)
        for candidate in with_trees(trials, plan, config):
            attempt(candidate)
    return tuple(trials)
