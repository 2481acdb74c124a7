"""`pipespec plan CONFIG`: recommend which stages to use, which device each runs on, and how far each runs ahead.

The stages are profiled first (pipespec.planning.profiling: forward latencies at one device's threads, per-pair
acceptance). The recommendation then enumerates every chain (each subsequence of the drafters, in order,
then the target; the target alone included), every placement of its stages on at most d devices
(pipespec.planning.placement: a device per stage, drafters sharing one, the target sharing with a drafter) and
per drafter a `max_lookahead` from a small grid, and predicts each with `PlacedChain.rate` of
pipespec.planning.analytical: the asynchronous chain model across devices, forwards serialized within a device,
verify costs included. The number of drafts one verification takes is what the runtime allows,
`PipelineConfig.window` of the candidate config. Rates are as a client sees whole requests
(`client_rate`): the profile times the target alone in the runtime on its prompts (`Requests`), so each
request's length and first delta (its prefill) count, and the target's step is its forward plus what the
runtime adds to it (`Profile.host_s`); the target alone is predicted as it was timed. So is each drafter that
can run alone: its step is its forward plus what the runtime added to it alone (`StageProfile.host_s`; a DREAM
drafter, which cannot, counts its forward). The fastest
candidate is recommended, or, within 2% of it, the one on fewer devices (then with fewer stages).
Synchronous speculative decoding with each drafter is shown beside it for reference (`sync_rate`; the
model's drafter-and-target-on-one-device candidate with window gamma predicts exactly that).

The model ranks; it does not know what a link between two actors costs, nor a DREAM drafter's step inside the
runtime, so its rates can be well off what runs (experiments/results/plan/repeats.md has how far, run by run).
So `pipespec plan` and `pipespec demo` then try candidates in
place (pipespec.cli.trials runs them): the fastest predicted on each number of devices, each drafter's
pair with the target, the next best-ranked chains, and the target alone (`contenders`), each round
timed beside the target alone in the planner's process. A `Trial` is one candidate's measurement;
`tried` recommends the greatest speedup measured, by the same near-tie rule (`TRIAL_TIE`), and its
measured rate and speedup become the plan's predictions (`Plan.predicted`, `Plan.predicted_speedup`),
the model's beside them.

`auto` is what `pipespec serve/demo --plan auto` run: a quick profile, then the recommended config.
"""

from __future__ import annotations

import itertools
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from pipespec.config import PipelineConfig, config_dict, load_config, sub_pipeline, with_stages
from pipespec.errors import ConfigError
from pipespec.planning.analytical import PlacedChain, client_rate, forward_latency, sync_rate
from pipespec.planning.placement import Devices, label, on_devices, placements
from pipespec.planning.profiling import IMAGE_PROMPTS, TEXT_PROMPTS, Profile, profile
from pipespec.protocol.tree_shape import TreeShape

LOOKAHEADS = (2, 4, 6, 8, 12, 16, 24, 32)  # 1 is left out: a window of 1 leaves the drafter nothing to run ahead with
# lookaheads whose predicted rate is within 3% of a candidate's best count as tied: the smallest wins. Near its top
# the model's rate is flat over lookaheads, and a tighter tie lets the profile's noise pick among equals.
TIE = 0.03
FEWER_STAGES = 0.02  # a candidate on fewer devices (then stages) within 2% of the best is recommended instead
# the same among trials, within 5% of the greatest speedup measured (wider, a slowed baseline can make the target
# alone the pick over a real speedup).
TRIAL_TIE = 0.05
AUTO_TOKENS = 48  # `--plan auto` profiles acceptance on one prompt of this many tokens: a few seconds


@dataclass(frozen=True)
class Candidate:
    stages: tuple[str, ...]  # upstream first; the last is the target
    placement: tuple[tuple[str, ...], ...]  # the stages on each device
    lookaheads: tuple[int, ...]  # max_lookahead per drafter (sync: gamma)
    windows: tuple[int, ...]  # most drafts one verification takes, per link, as the runtime allows
    tokens_per_s: float  # predicted
    speedup: float  # over the target alone, predicted
    synchronous: bool = False
    tree: TreeShape | None = None  # the stage right before the target offers it draft trees of this shape; None: chains

    @property
    def devices(self) -> int:
        return len(self.placement)

    @property
    def chain(self) -> str:
        return " -> ".join(self.stages) + (" (trees)" if self.tree else "")


@dataclass(frozen=True)
class Trial:
    """One candidate run in place: its tokens per second in each round, and the target alone's in the
    planner's process right after it, in the same round (pipespec.cli.trials)."""

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
        return f"{c.chain} on {label(c.placement)}, {self.tokens_per_s:.1f} tok/s ({self.speedup:.2f}x)"


@dataclass(frozen=True)
class Plan:
    profile: Profile
    recommended: Candidate
    chains: tuple[Candidate, ...]  # every valid chain on every placement, at its best lookaheads, fastest first
    synchronous: tuple[Candidate, ...]  # synchronous speculative decoding per drafter, for reference
    target_tokens_per_s: float  # predicted
    devices: Devices | None = None  # what the placements fit; None: a device per stage, none shared
    trials: tuple[Trial, ...] = ()  # candidates run in place (pipespec.planning.trial), greatest speedup first; () untried

    @property
    def predicted(self) -> float:
        """Tokens per second the recommended config is expected to deliver: measured in place when it was
        tried, else the model's."""
        trial = self._trial()
        return trial.tokens_per_s if trial else self.recommended.tokens_per_s

    @property
    def predicted_speedup(self) -> float:
        """Its speedup over the target alone: measured in place, side by side, when tried, else the model's."""
        trial = self._trial()
        return trial.speedup if trial else self.recommended.speedup

    def _trial(self) -> Trial | None:
        """The recommended candidate's trial, None when it was not tried."""
        return next((t for t in self.trials if t.candidate == self.recommended), None)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "predicted_tokens_per_s": self.predicted, "predicted_speedup": self.predicted_speedup}


# ---- recommendation --------------------------------------------------------------------------------


def recommend(
    prof: Profile, config: PipelineConfig, devices: Devices | None = None, lookaheads: Sequence[int] = LOOKAHEADS
) -> Plan:
    """Predict every valid chain on every placement on at most `devices.count` devices (None: a device per
    stage) at every grid of lookaheads; recommend the fastest (fewer devices, then stages, on a near tie)."""
    n = len(prof.stages)
    alone = _seen(prof, 1.0 / _target_s(prof)[0])
    chains: list[Candidate] = []
    for size in range(n):
        for drafters in itertools.combinations(range(n - 1), size):
            indices = [*drafters, n - 1]
            ways = placements(len(indices), devices.count) if devices else [tuple(range(len(indices)))]
            chains += [c for c in (_best_chain(prof, config, indices, p, devices, lookaheads, alone) for p in ways) if c]
    if not chains:
        raise ConfigError(f"pipespec plan: no chain of {[s.name for s in prof.stages]} can be placed on {devices}")
    chains.sort(key=lambda c: -c.tokens_per_s)
    recommended = _preferred(chains, lambda c: c, lambda c: c.tokens_per_s, FEWER_STAGES)
    sync = tuple(s for s in (_best_sync(prof, i, lookaheads, alone) for i in range(n - 1)) if s is not None)
    return Plan(prof, recommended, tuple(chains), tuple(sorted(sync, key=lambda c: -c.tokens_per_s)), alone, devices)


def contenders(plan: Plan, count: int) -> list[Candidate]:
    """What to try in place, `count` in all (the recommended one at least): the recommended candidate, the
    fastest predicted on each number of devices (the recommended one's too, where the near-tie rule picked
    another), then, while there is room, each drafter's pair with the target (its fastest predicted
    placement) unless that chain is already among them, then the fastest predicted of the rest; then the
    target alone (no speculation), unless it is among them. Every number of devices and every drafter's pair
    is tried because the model's error depends on both (experiments/results/plan/repeats.md)."""

    def key(c: Candidate) -> tuple[tuple[str, ...], int]:
        return c.stages, c.devices

    per_count: dict[int, Candidate] = {}
    pairs: dict[str, Candidate] = {}  # drafter -> its pair with the target
    for candidate in plan.chains:  # fastest first
        per_count.setdefault(candidate.devices, candidate)
        if len(candidate.stages) == 2:
            pairs.setdefault(candidate.stages[0], candidate)
    chosen = [plan.recommended]

    def offer(candidates: Iterable[Candidate], same: Callable[[Candidate], Any]) -> None:
        for candidate in candidates:
            if len(chosen) < count and all(same(candidate) != same(c) for c in chosen):
                chosen.append(candidate)

    offer(per_count.values(), key)
    offer(pairs.values(), lambda c: c.stages)  # a chain tried on any number of devices counts
    offer(plan.chains, key)
    alone = next((c for c in plan.chains if len(c.stages) == 1), None)
    return chosen if alone is None or alone in chosen else [*chosen, alone]


def with_trees(trials: Sequence[Trial], plan: Plan, config: PipelineConfig) -> list[Candidate]:
    """What to try after `trials`: the chain of greatest speedup among them that has a drafter, again with draft
    trees (`tree_shape`; none if no such chain was tried). Whether trees pay depends on the device (what a wider
    forward costs) and the pair (experiments/results/trees), so they are measured beside the chain, not predicted."""
    chained = [t for t in trials if len(t.candidate.stages) > 1 and t.candidate.tree is None and not t.candidate.synchronous]
    if not chained:
        return []
    best = max(chained, key=lambda t: t.speedup).candidate
    shape = tree_shape(plan.profile, config, best.stages[-2])
    return [] if shape is None else [replace(best, tree=shape)]


def tree_shape(prof: Profile, config: PipelineConfig, drafter: str) -> TreeShape | None:
    """The trees `drafter` offers the target in a candidate: as many nodes as the target's widest forward holds beside
    its root, the drafter's values calibrated as profiled (its pair's `temperature`); None if that is none."""
    target = config.target
    widest = getattr(target.options, "max_width", None) or 8  # a mock's forwards have no widest: a model's default
    if widest < 2:
        return None
    pair = next((p for p in prof.pairs if (p.drafter, p.verifier) == (drafter, target.name)), None)
    temperature = pair.temperature if pair is not None and pair.temperature else 1.0
    return TreeShape(budget=widest - 1, temperature=temperature)


def tried(plan: Plan, trials: Sequence[Trial]) -> Plan:
    """`plan` with its trials, the greatest speedup first, recommending that one (or, within `TRIAL_TIE`,
    one on fewer devices, then with fewer stages). ValueError without trials."""
    if not trials:
        raise ValueError("tried: no trials")
    ranked = sorted(trials, key=lambda t: -t.speedup)
    chosen = _preferred(ranked, lambda t: t.candidate, lambda t: t.speedup, TRIAL_TIE)
    return replace(plan, recommended=chosen.candidate, trials=tuple(ranked))


def _preferred(items: Sequence[Any], candidate: Callable[[Any], Candidate], score: Callable[[Any], float], tie: float) -> Any:
    """The item of greatest score or, within `tie` of it, the one whose candidate is on fewer devices,
    then has fewer stages: a near tie goes to the simpler pipeline."""
    best = max(score(item) for item in items)
    near = (item for item in items if score(item) >= (1 - tie) * best)
    return min(near, key=lambda item: (candidate(item).devices, len(candidate(item).stages), -score(item)))


def _best_chain(
    prof: Profile,
    config: PipelineConfig,
    indices: Sequence[int],
    placement: tuple[int, ...],
    devices: Devices | None,
    grid: Sequence[int],
    alone: float,
) -> Candidate | None:
    """The chain's best lookaheads on `placement` (the smallest among near ties), or None if the chain or
    its placement is not a valid config (stages on one device with different torch devices) or a link is unmeasured."""
    names = [prof.stages[i].name for i in indices]
    alphas = [prof.alpha(a, b) for a, b in itertools.pairwise(names)]
    if any(a is None for a in alphas):
        return None
    groups = on_devices(names, placement)
    try:
        chain = placed(config, names, groups, devices)
    except ConfigError:
        return None
    drafters = [prof.stages[i] for i in indices[:-1]]
    target_one_s, target_block_s = _target_s(prof)
    one_s = [s.forward_s + s.host_s for s in drafters] + [target_one_s]
    block_s = [s.verify_s + s.host_s for s in drafters] + [target_block_s]
    scored = []
    for combo in itertools.product(grid, repeat=len(indices) - 1):
        windows = _windows(chain, combo)
        rate = PlacedChain(one_s, block_s, prof.stages[-1].verify_tokens, alphas, windows, placement).rate()
        scored.append((_seen(prof, rate), combo, windows))
    top = max(rate for rate, _, _ in scored)
    rate, combo, windows = min((s for s in scored if s[0] >= (1 - TIE) * top), key=lambda s: (sum(s[1]), s[1]))
    return Candidate(tuple(names), groups, tuple(combo), tuple(windows), rate, rate / alone)


def _target_s(prof: Profile) -> tuple[float, float]:
    """The target's seconds for a 1-token and a `verify_tokens`-token step in the runtime: its forwards
    plus what the runtime adds to each step (`Profile.host_s`; a drafter's steps are its forwards plus its own
    `StageProfile.host_s`)."""
    target = prof.stages[-1]
    return target.forward_s + prof.host_s, target.verify_s + prof.host_s


def _seen(prof: Profile, rate: float) -> float:
    """A decoding `rate` as a client sees the profile's requests: their lengths and first deltas
    (`client_rate`); the rate itself when the requests were not timed."""
    timed = prof.requests
    return client_rate(rate, timed.tokens, timed.first_s) if timed and sum(timed.tokens) else rate


def _windows(config: PipelineConfig, lookaheads: Sequence[int]) -> tuple[int, ...]:
    """Most drafts a verification takes on each link when the drafters run `lookaheads` ahead."""
    stages = tuple(replace(s, max_lookahead=la) for s, la in zip(config.stages, lookaheads)) + config.stages[len(lookaheads) :]
    chain = replace(config, stages=stages)
    return tuple(min(chain.window(i + 1), la) for i, la in enumerate(lookaheads))


def _best_sync(prof: Profile, i: int, grid: Sequence[int], alone: float) -> Candidate | None:
    drafter, target = prof.stages[i], prof.stages[-1]
    alpha = prof.alpha(drafter.name, target.name)
    if alpha is None:
        return None

    def rate(gamma: int) -> float:
        verify_s = forward_latency(*_target_s(prof), target.verify_tokens, gamma + 1)
        return _seen(prof, sync_rate(alpha, gamma, drafter.forward_s + drafter.host_s, verify_s))

    gamma = max(grid, key=rate)
    names = (drafter.name, target.name)
    return Candidate(names, (names,), (gamma,), (gamma,), rate(gamma), rate(gamma) / alone, synchronous=True)


# ---- the recommended config ------------------------------------------------------------------------


def placed(
    config: PipelineConfig, names: Sequence[str], groups: Sequence[Sequence[str]], devices: Devices | None
) -> PipelineConfig:
    """`config`'s chain of the stages `names` (`sub_pipeline`, under the config's own name) placed on `groups`: stages
    sharing a device get the `device_group` named after them (`tiny+dream`), the others a device each, and with
    `devices`, every stage the resources of one device (its own, num_cpus set to the device's cores). ConfigError if
    that is no valid chain (stages on one device with different torch devices)."""
    chain = sub_pipeline(config, names)
    group_of = {name: "+".join(group) for group in groups if len(group) > 1 for name in group}
    stages = [
        replace(
            s,
            device_group=group_of.get(s.name),
            resources={**s.resources, "num_cpus": devices.cpus} if devices is not None else s.resources,
        )
        for s in chain.stages
    ]
    return with_stages(replace(chain, name=config.name), stages)


def candidate_config(config: PipelineConfig, candidate: Candidate, devices: Devices | None) -> PipelineConfig:
    """`config` as `candidate` runs it: the stages it leaves out dropped, the rest placed as it says on `devices`
    (`placed`), each drafter's max_lookahead its own, draft trees offered only where it offers them (a stage that
    offers trees pre-drafts nothing)."""
    chain = placed(config, candidate.stages, candidate.placement, devices)
    lookaheads = dict(zip(candidate.stages, candidate.lookaheads))
    stages = [replace(s, max_lookahead=lookaheads.get(s.name, s.max_lookahead), tree=None) for s in chain.stages]
    if candidate.tree is not None:
        stages[-2] = replace(stages[-2], tree=candidate.tree, predraft=0)
    return with_stages(chain, stages)


def recommended_config(config: PipelineConfig, plan: Plan) -> PipelineConfig:
    """`candidate_config` of the plan's recommendation."""
    return candidate_config(config, plan.recommended, plan.devices)


def write_config(config: PipelineConfig, plan: Plan, path: str | os.PathLike) -> None:
    """The plan's recommendation as a config file (every default filled in, as `pipespec config` prints one)."""
    chosen = plan.recommended
    how = "measured in place" if plan.trials else "predicted"
    header = (
        f"# recommended by `pipespec plan`: {chosen.chain} on {label(chosen.placement)}, "
        f"{plan.predicted:.1f} tok/s, {plan.predicted_speedup:.2f}x the target alone, {how}\n"
    )
    Path(path).write_text(header + yaml.safe_dump(config_dict(recommended_config(config, plan)), sort_keys=False))


def auto(
    source: PipelineConfig | str | os.PathLike | Mapping[str, Any],
    devices: Devices,
    prompts: Sequence[str] | None = None,
    image: Any = None,
    max_new_tokens: int = AUTO_TOKENS,
) -> tuple[PipelineConfig, Plan]:
    """What `--plan auto` runs: a quick profile (`prompts`, default one built-in; forwards at one device's
    threads), the recommendation for `devices` -> (the recommended config, the plan)."""
    config = source if isinstance(source, PipelineConfig) else load_config(source)
    quick = prompts or (IMAGE_PROMPTS if image is not None else TEXT_PROMPTS)[:1]
    plan = recommend(profile(config, quick, image, max_new_tokens, torch_threads=devices.threads), config, devices)
    return recommended_config(config, plan), plan


# ---- report ----------------------------------------------------------------------------------------


def explain(plan: Plan) -> str:
    """Two lines: what the plan chose (chain, placement, lookaheads, tokens per second: measured in place
    when tried, else predicted) and why."""
    r = plan.recommended
    ahead = ", ".join(f"{name}={la}" for name, la in zip(r.stages, r.lookaheads)) or "none (no drafters)"
    chose = f"recommended: {' -> '.join(r.stages)} on {_devices(r.devices)} ({label(r.placement)}), max_lookahead {ahead}: "
    trial = plan._trial()
    if trial is not None:
        return chose + _explain_trial(plan, trial)
    chose += f"{r.tokens_per_s:.1f} tok/s predicted, {r.speedup:.2f}x the target alone ({plan.target_tokens_per_s:.1f} tok/s)"
    limit = f"on at most {_devices(plan.devices.count)}" if plan.devices else "a device per stage"
    fastest, others = plan.chains[0], [c for c in plan.chains if c != r]
    if fastest != r:
        return f"{chose}\nwhy: within {FEWER_STAGES:.0%} of the fastest ({_row(fastest)}) on fewer {_fewer(r, fastest)}"
    why = f"the fastest of {len(plan.chains)} candidates {limit}"
    if others:
        near = others[0].tokens_per_s >= (1 - FEWER_STAGES) * r.tokens_per_s and _fewer(r, others[0])
        why += f"; next: {_row(others[0])}" + (f", within {FEWER_STAGES:.0%} but on more {near}" if near else "")
    return f"{chose}\nwhy: {why}"


def _explain_trial(plan: Plan, trial: Trial) -> str:
    r = plan.recommended
    chose = (
        f"{trial.tokens_per_s:.1f} tok/s measured in place, {trial.speedup:.2f}x the target alone in this process "
        f"({statistics.median(trial.alone):.1f} tok/s, side by side); the model predicted {r.tokens_per_s:.1f} ({r.speedup:.2f}x)"
    )
    best, others = plan.trials[0], [t for t in plan.trials if t is not trial]
    if best is not trial:
        why = f"within {TRIAL_TIE:.0%} of the greatest speedup tried ({best}) on fewer {_fewer(r, best.candidate)}"
    else:
        why = f"the greatest speedup of {len(plan.trials)} tried in place" + "".join(f"; next: {t}" for t in others[:1])
    return f"{chose}\nwhy: {why}"


def _fewer(chosen: Candidate, other: Candidate) -> str:
    """What the chosen candidate needs fewer of than the other, devices or stages ('' if neither): what breaks a near tie."""
    if chosen.devices != other.devices:
        return "devices" if chosen.devices < other.devices else ""
    return "stages" if len(chosen.stages) < len(other.stages) else ""


def _row(c: Candidate) -> str:
    return f"{c.chain} on {label(c.placement)}, {c.tokens_per_s:.1f} tok/s"


def _devices(count: int) -> str:
    return f"{count} device{'s' if count != 1 else ''}"


def format_plan(plan: Plan, top: int = 12) -> str:
    """The plan as a readable table: stage latencies, pair acceptances, the best candidates, the recommendation."""
    prof = plan.profile
    k = prof.stages[0].verify_tokens
    cores = plan.devices and f"{plan.devices.cpus:g} core{'s' if plan.devices.cpus != 1 else ''}"
    fit = f"; {_devices(plan.devices.count)} of {cores}" if plan.devices else ""
    threads = f", {prof.torch_threads} torch thread{'s' if prof.torch_threads != 1 else ''}" if prof.torch_threads else ""
    lines = [
        f"pipespec plan: {prof.config_name} ({len(prof.prompts)} prompt{'s' if len(prof.prompts) != 1 else ''} x "
        f"{prof.max_new_tokens} new tokens, greedy{threads}" + (f", image: {prof.image}" if prof.image else "") + f"{fit})",
        "",
        f"{'stage':<16}{'kind':<11}{'1-token fwd':>13}{f'{k}-token fwd':>14}",
    ]
    lines += [
        f"{s.name:<16}{s.kind:<11}{s.forward_s * 1e3:>10.2f} ms{s.verify_s * 1e3:>11.2f} ms"
        + (
            f"   alone in the runtime: {s.step_s * 1e3:.2f} ms a token, {s.host_s * 1e3:.2f} ms besides the forward"
            if s.step_s
            else ""
        )
        for s in prof.stages
    ]
    if prof.requests is not None:
        timed = prof.requests
        lines.append(
            f"{prof.stages[-1].name} alone in the runtime: {timed.tokens_per_s:.1f} tok/s as a client sees it, answers of "
            f"{_ints(timed.tokens)} tokens, first deltas {_ints([round(f * 1e3) for f in timed.first_s])} ms, "
            f"{prof.host_s * 1e3:.2f} ms a step besides the forward"
        )
    lines += ["", f"{'drafter -> verifier':<28}{'alpha':>7}{'drafted':>9}{'accepted':>10}{'mean acc. len':>15}"]
    for p in prof.pairs:
        pair = f"{p.drafter} -> {p.verifier}"
        if p.alpha is None:
            lines.append(f"{pair:<28}{'skipped':>7}  {p.skipped}")
        else:
            lines.append(
                f"{pair:<28}{p.alpha:>7.3f}{p.num_draft_tokens:>9}{p.num_accepted_tokens:>10}{p.mean_acceptance_length:>15.2f}"
            )
    rows = list(plan.chains[:top]) + list(plan.synchronous)
    chain_w = max(len("chain (predicted)"), *(len(c.chain) for c in [*rows, *(t.candidate for t in plan.trials)])) + 2
    place_w = max(len("placement"), *(len(label(c.placement)) for c in rows)) + 2
    lines += [
        "",
        f" {'chain (predicted)':<{chain_w}}{'placement':<{place_w}}{'mode':<7}{'lookaheads':>12}{'windows':>10}{'tok/s':>10}{'speedup':>9}",
    ]
    for c in rows:
        mark = "*" if c == plan.recommended else " "
        lines.append(
            f"{mark}{c.chain:<{chain_w}}{label(c.placement):<{place_w}}{'sync' if c.synchronous else 'async':<7}"
            f"{_ints(c.lookaheads):>12}{_ints(c.windows):>10}{c.tokens_per_s:>10.1f}{c.speedup:>8.2f}x"
        )
    if len(plan.chains) > top:
        lines.append(f" ({len(plan.chains) - top} slower candidates not shown)")
    if plan.trials:
        lines += ["", *_trial_lines(plan, chain_w, place_w)]
    return "\n".join([*lines, "", explain(plan)])


def _trial_lines(plan: Plan, chain_w: int, place_w: int) -> list[str]:
    """The trials' table: each tried chain's model prediction beside its rounds measured in place."""
    rounds = len(plan.trials[0].rounds)
    lines = [
        f"tried in place (a local Ray, {rounds} rounds of the prompts above, each then sent to the target alone in this "
        "process; whole requests, as a client sees them):",
        f" {'chain (tried)':<{chain_w}}{'placement':<{place_w}}{'lookaheads':>12}{'model':>10}{'measured':>10}{'speedup':>9}"
        "  rounds (target alone)",
    ]
    for t in plan.trials:
        c = t.candidate
        mark = "*" if c == plan.recommended else " "
        each = " / ".join(f"{p:.1f} ({a:.1f})" for p, a in zip(t.rounds, t.alone))
        lines.append(
            f"{mark}{c.chain:<{chain_w}}{label(c.placement):<{place_w}}{_ints(c.lookaheads):>12}"
            f"{c.tokens_per_s:>10.1f}{t.tokens_per_s:>10.1f}{t.speedup:>8.2f}x  {each}"
        )
    return lines


def _ints(values: Sequence[int]) -> str:
    return ",".join(map(str, values)) or "-"
