"""`pipespec plan CONFIG`: measure a pipeline's stages, then recommend which to use and how far each runs ahead.

Profiling loads the config's stages once, in this process, and measures on a few prompts (greedy):

- per stage, the median seconds of a 1-token forward and of a `verify_tokens`-token forward after a
  prefill (what a decoding step and a verification step cost);
- per ordered pair (drafter i, verifier j > i) that can be a link of a valid chain, the per-token
  acceptance alpha, from `generate_sync(verifier, request, drafter)` (pipespec.synchronous). A pair
  whose verifier is a DREAM stage runs the target beside it to hand it the target's features
  (`pipespec.handoff.FeaturedVerifier`); a pair
  that no valid chain contains is skipped with the config error that says why.

The recommendation enumerates every chain (each subsequence of the drafters, in order, then the
target; the target alone included) and per drafter a `max_lookahead` from a small grid, and predicts
each chain's tokens per second with the asynchronous chain model of pipespec.analytical, verify costs
included (`chain_rates_with_verify_cost`); the number of drafts one verification takes is what the
runtime allows, `PipelineConfig.window` of the candidate config. Synchronous speculative decoding with
each drafter is shown beside it for reference (`sync_rate`). The model assumes every stage on its own
device; on one shared CPU the stages of a pipeline compete for the cores.

Mock stages emulate their agreement with whichever stage follows them, so a mock drafter is built anew
for each pair, as it would be in a chain where that verifier follows it; model stages load once.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from pipespec.analytical import chain_rates_with_verify_cost, forward_latency, sync_rate
from pipespec.config import ConfigError, PipelineConfig, load_config
from pipespec.handoff import FeaturedVerifier, hand_prefill
from pipespec.messages import RequestSpec
from pipespec.stage import Session, Stage
from pipespec.stages.registry import kind_of
from pipespec.stats import PairStats
from pipespec.synchronous import generate_sync

log = logging.getLogger(__name__)

TEXT_PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works, step by step.",
    "List five things to pack for a trip to the mountains.",
)
IMAGE_PROMPTS = ("Describe the image.", "How many shapes are there?", "What colour is the background?")
LOOKAHEADS = (2, 4, 6, 8, 12, 16, 24, 32)  # 1 is left out: a window of 1 leaves the drafter nothing to run ahead with
TIE = 0.01  # lookaheads whose predicted rate is within 1% of a chain's best count as tied: the smallest wins
FEWER_STAGES = 0.02  # a chain with fewer stages within 2% of the best is recommended instead (fewer devices)


@dataclass(frozen=True)
class StageProfile:
    name: str
    kind: str
    forward_s: float  # median seconds of a 1-token forward after the prefill
    verify_s: float  # median seconds of a `verify_tokens`-token forward
    verify_tokens: int


@dataclass(frozen=True)
class PairProfile:
    drafter: str
    verifier: str
    alpha: float | None  # per-token acceptance (PairStats.token_acceptance); None when skipped
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_acceptance_length: float = 1.0
    skipped: str | None = None  # why the pair was not measured


@dataclass(frozen=True)
class Profile:
    config_name: str
    stages: tuple[StageProfile, ...]  # upstream first; the last is the target
    pairs: tuple[PairProfile, ...]
    prompts: tuple[str, ...]
    image: str | None  # what the VLM target looked at, if anything
    max_new_tokens: int
    gamma: int  # drafts per step when measuring acceptance

    def alpha(self, drafter: str, verifier: str) -> float | None:
        return next((p.alpha for p in self.pairs if (p.drafter, p.verifier) == (drafter, verifier)), None)


@dataclass(frozen=True)
class Candidate:
    stages: tuple[str, ...]  # upstream first; the last is the target
    lookaheads: tuple[int, ...]  # max_lookahead per drafter (sync: gamma)
    windows: tuple[int, ...]  # most drafts one verification takes, per link, as the runtime allows
    tokens_per_s: float  # predicted
    speedup: float  # over the target alone, predicted
    synchronous: bool = False


@dataclass(frozen=True)
class Plan:
    profile: Profile
    recommended: Candidate
    chains: tuple[Candidate, ...]  # the best lookaheads of every valid chain, fastest first
    synchronous: tuple[Candidate, ...]  # synchronous speculative decoding per drafter, for reference
    target_tokens_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- profiling -------------------------------------------------------------------------------------


def read_config(source: str | os.PathLike | Mapping[str, Any]) -> tuple[PipelineConfig, dict[str, Any]]:
    """-> (the validated config, its raw mapping, from which sub-chains and the recommended config are cut)."""
    config = load_config(source)
    raw = dict(source) if isinstance(source, Mapping) else yaml.safe_load(Path(source).read_text())
    return config, raw


def sub_config(raw: Mapping[str, Any], indices: Sequence[int]) -> PipelineConfig:
    """The config of the chain of stages `indices` (upstream first); ConfigError says why it is invalid."""
    return load_config({**raw, "stages": [raw["stages"][i] for i in indices]})


def profile(
    source: str | os.PathLike | Mapping[str, Any],
    prompts: Sequence[str] | None = None,
    image: Any = None,
    max_new_tokens: int = 64,
    verify_tokens: int = 8,
    repeats: int = 5,
    gamma: int = 4,
    torch_threads: int | None = 1,
) -> Profile:
    """Measure every stage's latencies and every pair's acceptance (see the module docstring).

    `image`: for a VLM target (required there), a path, bytes, PIL image or data URL. `torch_threads`: 1, as each stage gets in a pipeline sharing this machine.
    """
    from pipespec.local import LocalPipeline

    if max_new_tokens <= verify_tokens:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must exceed verify_tokens ({verify_tokens})")
    config, raw = read_config(source)
    picture, image_name = _image(config, image)
    prompts = tuple(prompts or (IMAGE_PROMPTS if picture is not None else TEXT_PROMPTS))
    pipeline = LocalPipeline(config, torch_threads=torch_threads)  # loads the stages; never started
    requests = [_request(pipeline, p, picture, max_new_tokens) for p in prompts]
    stages = tuple(
        _profile_stage(pipeline.stages, i, config, requests[0], verify_tokens, repeats) for i in range(len(config.stages))
    )
    valid = pipeline.entrance.tokenizer_size
    pairs = tuple(
        _profile_pair(pipeline.stages, [s.name for s in config.stages], raw, i, j, requests, gamma, valid)
        for i, j in itertools.combinations(range(len(config.stages)), 2)
    )
    return Profile(config.name, stages, pairs, prompts, image_name, max_new_tokens, gamma)


def _image(config: PipelineConfig, image: Any) -> tuple[Any, str | None]:
    """-> (the decoded picture or None, how to name it); a bad image or an image for a text target is a ValueError."""
    from pipespec.images import load_image

    target = config.target
    takes_images = kind_of(target).takes_images
    if image is not None and not takes_images:
        raise ValueError(f"target stage {target.name!r} ({target.kind}) does not take images")
    if not takes_images:
        return None, None
    if image is None:
        raise ValueError(f"target stage {target.name!r} ({target.kind}) takes images: profile it with --image FILE")
    return load_image(image), str(image) if isinstance(image, (str, os.PathLike)) else type(image).__name__


def _request(pipeline: Any, prompt: str, image: Any, max_new_tokens: int) -> RequestSpec:
    """A greedy request through the pipeline's front door. Mock pipelines have no tokenizer: their
    prompt is the text's UTF-8 bytes modulo the vocabulary."""
    if pipeline.tokenizer is None and pipeline.front_door.processor is None:
        vocab = pipeline.stages[-1].vocab_size
        spec, _ = pipeline.request(
            prompt_token_ids=[b % vocab for b in prompt.encode()], max_new_tokens=max_new_tokens, temperature=0.0
        )
    else:
        spec, _ = pipeline.request(prompt, image=image, max_new_tokens=max_new_tokens, temperature=0.0)
    return spec


def _open(stage: Stage, target: Stage, spec: RequestSpec, reads_features: bool) -> Session:
    """Open `stage` on `spec`; a DREAM stage (`reads_features`) also gets the target's prefill features."""
    session = stage.open(spec)
    if reads_features:
        target_session = target.open(spec)
        try:
            hand_prefill(session, target_session, spec.request_id)
        finally:
            target_session.close()
    return session


def _greedy(logits: Any) -> int:
    return int(logits[-1].argmax())


def time_forwards(session: Session, verify_tokens: int, repeats: int) -> tuple[float, float]:
    """-> median seconds of a 1-token forward and of a `verify_tokens`-token forward, after the prefill.

    One warm-up forward (a DREAM stage prefills in its first), then greedy 1-token steps, then the
    block of the tokens they generated, fed again and again at the same place (each call rolls back)."""
    fed = session.prompt_len - 1
    token = _greedy(session.forward(fed, [session.last_prompt_token]))
    fed += 1
    generated: list[int] = []
    ones: list[float] = []
    for _ in range(max(repeats, verify_tokens)):
        start = time.perf_counter()
        logits = session.forward(fed + len(generated), [token])
        ones.append(time.perf_counter() - start)
        generated.append(token)
        token = _greedy(logits)
    blocks: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.forward(fed, generated[:verify_tokens])
        blocks.append(time.perf_counter() - start)
    return statistics.median(ones), statistics.median(blocks)


def _profile_stage(
    stages: Sequence[Stage], i: int, config: PipelineConfig, spec: RequestSpec, verify_tokens: int, repeats: int
) -> StageProfile:
    session = _open(stages[i], stages[-1], spec, kind_of(config.stages[i]).reads_target_features)
    try:
        one_s, block_s = time_forwards(session, verify_tokens, repeats)
    finally:
        session.close()
    name = config.stages[i].name
    log.info("stage %s: %.2f ms a token, %.2f ms for %d", name, one_s * 1e3, block_s * 1e3, verify_tokens)
    return StageProfile(name, config.stages[i].kind, one_s, block_s, verify_tokens)


def _profile_pair(
    stages: Sequence[Stage],
    names: Sequence[str],
    raw: Mapping[str, Any],
    i: int,
    j: int,
    requests: Sequence[RequestSpec],
    gamma: int,
    valid: int | None,
) -> PairProfile:
    """Stage i drafting for stage j in the chain (i, j, ..., target); skipped if that chain is invalid."""
    try:
        chain = sub_config(raw, [i, *range(j, len(names))])
    except ConfigError as e:
        log.info("pair %s -> %s skipped: %s", names[i], names[j], e)
        return PairProfile(names[i], names[j], None, skipped=str(e))
    drafter = _drafter(stages[i], chain, stages[-1].vocab_size, valid)
    verifier = FeaturedVerifier(stages[j], stages[-1]) if kind_of(chain.stages[1]).reads_target_features else stages[j]
    total = PairStats(names[i], names[j])
    for spec in requests:
        total.merge(generate_sync(verifier, spec, drafter, gamma).pair)
    log.info("pair %s -> %s: alpha %.3f over %d drafts", names[i], names[j], total.token_acceptance, total.num_draft_tokens)
    return PairProfile(
        names[i],
        names[j],
        total.token_acceptance,
        total.num_draft_tokens,
        total.num_accepted_tokens,
        total.mean_acceptance_length,
    )


def _drafter(loaded: Stage, chain: PipelineConfig, width: int, valid: int | None) -> Stage:
    """The drafter of the chain's first link: a mock is rebuilt for this chain (its agreement is with the
    stage after it); any other stage does not depend on its chain, so the loaded one serves."""
    if not kind_of(chain.stages[0]).depends_on_chain:
        return loaded
    from pipespec.stages import build_stage

    return build_stage(chain.stages[0], chain.stages, width, valid)


# ---- recommendation --------------------------------------------------------------------------------


def recommend(prof: Profile, raw: Mapping[str, Any], lookaheads: Sequence[int] = LOOKAHEADS) -> Plan:
    """Predict every valid chain at every grid of lookaheads; recommend the fastest (fewer stages on a near tie)."""
    n = len(prof.stages)
    target = prof.stages[-1]
    alone = 1.0 / target.forward_s
    chains: list[Candidate] = []
    for size in range(n):
        for drafters in itertools.combinations(range(n - 1), size):
            best = _best_chain(prof, raw, [*drafters, n - 1], lookaheads, alone)
            if best is not None:
                chains.append(best)
    chains.sort(key=lambda c: -c.tokens_per_s)
    fastest = chains[0].tokens_per_s
    recommended = min(
        (c for c in chains if c.tokens_per_s >= (1 - FEWER_STAGES) * fastest), key=lambda c: (len(c.stages), -c.tokens_per_s)
    )
    sync = tuple(s for s in (_best_sync(prof, i, lookaheads, alone) for i in range(n - 1)) if s is not None)
    return Plan(prof, recommended, tuple(chains), tuple(sorted(sync, key=lambda c: -c.tokens_per_s)), alone)


def _best_chain(
    prof: Profile, raw: Mapping[str, Any], indices: Sequence[int], grid: Sequence[int], alone: float
) -> Candidate | None:
    """The chain's best lookaheads (the smallest among near ties), or None if no valid chain or unmeasured link."""
    names = [prof.stages[i].name for i in indices]
    alphas = [prof.alpha(a, b) for a, b in itertools.pairwise(names)]
    if any(a is None for a in alphas):
        return None
    try:
        config = sub_config(raw, indices)
    except ConfigError:
        return None
    stages = [prof.stages[i] for i in indices]
    scored = []
    for combo in itertools.product(grid, repeat=len(indices) - 1):
        windows = _windows(config, combo)
        rates = chain_rates_with_verify_cost(
            [s.forward_s for s in stages], [s.verify_s for s in stages], stages[-1].verify_tokens, alphas, windows
        )
        scored.append((rates[-1], combo, windows))
    top = max(rate for rate, _, _ in scored)
    rate, combo, windows = min((s for s in scored if s[0] >= (1 - TIE) * top), key=lambda s: (sum(s[1]), s[1]))
    return Candidate(tuple(names), tuple(combo), tuple(windows), rate, rate / alone)


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
        verify_s = forward_latency(target.forward_s, target.verify_s, target.verify_tokens, gamma + 1)
        return sync_rate(alpha, gamma, drafter.forward_s, verify_s)

    gamma = max(grid, key=rate)
    return Candidate((drafter.name, target.name), (gamma,), (gamma,), rate(gamma), rate(gamma) / alone, synchronous=True)


def recommended_config(raw: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """The original config with the stages the plan leaves out dropped and each drafter's max_lookahead set;
    validated by load_config."""
    chosen = plan.recommended
    by_name = {s.name: raw["stages"][k] for k, s in enumerate(load_config(raw).stages)}
    stages = [dict(by_name[name], max_lookahead=la) for name, la in zip(chosen.stages, chosen.lookaheads)]
    out = {**raw, "stages": [*stages, dict(by_name[chosen.stages[-1]])]}
    load_config(out)
    return out


def write_config(raw: Mapping[str, Any], plan: Plan, path: str | os.PathLike) -> None:
    chosen = plan.recommended
    header = (
        f"# recommended by `pipespec plan`: {' -> '.join(chosen.stages)}, predicted {chosen.tokens_per_s:.1f} tok/s "
        f"({chosen.speedup:.2f}x the target alone)\n"
    )
    Path(path).write_text(header + yaml.safe_dump(recommended_config(raw, plan), sort_keys=False))


# ---- report ----------------------------------------------------------------------------------------


def format_plan(plan: Plan, top: int = 8) -> str:
    """The plan as a readable table: stage latencies, pair acceptances, the best chains, the recommendation."""
    prof = plan.profile
    k = prof.stages[0].verify_tokens
    lines = [
        f"pipespec plan: {prof.config_name} ({len(prof.prompts)} prompt{'s' if len(prof.prompts) != 1 else ''} x "
        f"{prof.max_new_tokens} new tokens, greedy" + (f", image: {prof.image})" if prof.image else ")"),
        "",
        f"{'stage':<16}{'kind':<11}{'1-token fwd':>13}{f'{k}-token fwd':>14}",
    ]
    lines += [f"{s.name:<16}{s.kind:<11}{s.forward_s * 1e3:>10.2f} ms{s.verify_s * 1e3:>11.2f} ms" for s in prof.stages]
    lines += ["", f"{'drafter -> verifier':<28}{'alpha':>7}{'drafted':>9}{'accepted':>10}{'mean acc. len':>15}"]
    for p in prof.pairs:
        pair = f"{p.drafter} -> {p.verifier}"
        if p.alpha is None:
            lines.append(f"{pair:<28}{'skipped':>7}  {p.skipped}")
        else:
            lines.append(
                f"{pair:<28}{p.alpha:>7.3f}{p.num_draft_tokens:>9}{p.num_accepted_tokens:>10}{p.mean_acceptance_length:>15.2f}"
            )
    lines += ["", f"{'chain (predicted)':<40}{'mode':<7}{'lookaheads':>12}{'windows':>10}{'tok/s':>10}{'speedup':>9}"]
    rows = list(plan.chains[:top]) + list(plan.synchronous)
    for c in rows:
        mark = "*" if c == plan.recommended else " "
        lines.append(
            f"{mark}{' -> '.join(c.stages):<39}{'sync' if c.synchronous else 'async':<7}{_ints(c.lookaheads):>12}"
            f"{_ints(c.windows):>10}{c.tokens_per_s:>10.1f}{c.speedup:>8.2f}x"
        )
    r = plan.recommended
    ahead = ", ".join(f"{name}={la}" for name, la in zip(r.stages, r.lookaheads)) or "none (no drafters)"
    lines += [
        "",
        f"recommended: {' -> '.join(r.stages)} (max_lookahead {ahead}): {r.tokens_per_s:.1f} tok/s predicted, "
        f"{r.speedup:.2f}x the target alone ({plan.target_tokens_per_s:.1f} tok/s)",
    ]
    return "\n".join(lines)


def _ints(values: Sequence[int]) -> str:
    return ",".join(map(str, values)) or "-"
