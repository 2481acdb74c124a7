"""Profiling for `pipespec plan`: what each stage's forwards cost and how often each pair agrees.

Profiling loads the config's stages once, in this process, and measures on a few prompts (greedy):

- per stage, the median seconds of a 1-token forward and of a `verify_tokens`-token forward after a
  prefill (what a decoding step and a verification step cost), at the torch threads of one device;
  everything here runs pinned to as many cores as those threads, as a device actor is pinned to its own
  (pipespec.engine.affinity.pinned);
- the target alone in the runtime (a `LocalPipeline` of the loaded target, in this process) on each
  prompt, timed as a client sees it (`Requests`): how many tokens each answer has, how long its first
  delta takes (the prefill), and the runtime's seconds per token after it, the forward's and the host's;
- per ordered pair (drafter i, verifier j > i) that can be a link of a valid chain, the per-token
  acceptance alpha, from `generate_sync(verifier, request, drafter)` (pipespec.engine.synchronous). A pair
  whose verifier is a DREAM stage runs the target beside it to hand it the target's features
  (`pipespec.engine.handoff.FeaturedVerifier`); a pair that no valid chain contains is skipped with the config
  error that says why.

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
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from pipespec.config import PipelineConfig, load_config, sub_pipeline
from pipespec.engine.affinity import pinned
from pipespec.engine.handoff import FeaturedVerifier, hand_prefill
from pipespec.engine.stage import Session, Stage
from pipespec.engine.synchronous import generate_sync
from pipespec.engine.tree_drafting import fit_temperature
from pipespec.errors import ConfigError
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.stats import PairStats
from pipespec.requests.generate_args import DEFAULT_MAX_NEW_TOKENS
from pipespec.schema.kinds import kind_of

log = logging.getLogger(__name__)

TEXT_PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works, step by step.",
    "List five things to pack for a trip to the mountains.",
)
IMAGE_PROMPTS = ("Describe the image.", "How many shapes are there?", "What colour is the background?")


@dataclass(frozen=True)
class StageProfile:
    name: str
    kind: str
    forward_s: float  # median seconds of a 1-token forward after the prefill
    verify_s: float  # median seconds of a `verify_tokens`-token forward
    verify_tokens: int
    step_s: float | None = None  # a drafter alone in the runtime: seconds per token after its first (`Requests.step_s`);
    # None: not timed (the target's requests are `Profile.requests`, its host cost `Profile.host_s`; a stage that
    # reads its verifier's features cannot run alone)

    @property
    def host_s(self) -> float:
        """What the runtime adds to this drafter's forward per step: its `step_s` less its forward, never below 0; 0
        when not timed. Alone, a drafter pays what it pays in a chain (dispatch to its compute thread, the hand-off
        back, its choice, its event loop's work) and also its commit to the coordinator and the client's stream,
        which it does not pay there (experiments/results/plan/repeats.md)."""
        return max(0.0, self.step_s - self.forward_s) if self.step_s else 0.0


@dataclass(frozen=True)
class PairProfile:
    drafter: str
    verifier: str
    alpha: float | None  # per-token acceptance (PairStats.token_acceptance); None when skipped
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_acceptance_length: float = 1.0
    skipped: str | None = None  # why the pair was not measured
    # the drafter's value temperature for draft trees (pipespec.engine.tree_drafting.fit_temperature), fitted on the
    # target's answers: a pair with the target only (trees are offered to the target); None: not fitted
    temperature: float | None = None


@dataclass(frozen=True)
class Requests:
    """The target alone in the runtime on the profile's prompts, greedy, timed as a client sees each request: its
    tokens cost more than its forwards, and its first delta waits for the prefill. The model's rates are turned into
    what a client sees from these."""

    tokens: tuple[int, ...]  # generated, per prompt
    first_s: tuple[float, ...]  # seconds to each request's first delta: its prefill, the runtime's and the stream's
    seconds: tuple[float, ...]  # each whole request

    @property
    def step_s(self) -> float | None:
        """Seconds per token after the first, over every request (None: no request went past its first token)."""
        later = sum(n - 1 for n in self.tokens)
        return sum(s - f for s, f in zip(self.seconds, self.first_s)) / later if later else None

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / sum(self.seconds)


@dataclass(frozen=True)
class Profile:
    config_name: str
    stages: tuple[StageProfile, ...]  # upstream first; the last is the target
    pairs: tuple[PairProfile, ...]
    prompts: tuple[str, ...]
    image: str | None  # what the VLM target looked at, if anything
    max_new_tokens: int
    gamma: int  # drafts per step when measuring acceptance
    torch_threads: int | None = None  # what the latencies were measured at (None: torch's own setting)
    requests: Requests | None = None  # the target alone in the runtime; None: not measured (the forwards alone count)

    def alpha(self, drafter: str, verifier: str) -> float | None:
        return next((p.alpha for p in self.pairs if (p.drafter, p.verifier) == (drafter, verifier)), None)

    @property
    def host_s(self) -> float:
        """What the runtime adds to the target's forward per step (sampling, dispatch, the client's stream):
        its seconds per token in the runtime less its forward alone, never below 0; 0 when the requests
        were not timed. The target's only: each drafter's is its own (`StageProfile.host_s`), timed alone (charged
        the target's, a cheap drafter would be held to its supply bound and every lookahead would look alike)."""
        return replace(self.stages[-1], step_s=self.requests and self.requests.step_s).host_s


def sub_config(config: PipelineConfig, indices: Sequence[int]) -> PipelineConfig:
    """The config of the chain of `config`'s stages `indices` (upstream first; the last one its target, a drafter
    alone included: `sub_pipeline`); ConfigError says why it is invalid."""
    return sub_pipeline(config, [config.stages[i].name for i in indices])


def profile(
    source: PipelineConfig | str | os.PathLike | Mapping[str, Any],
    prompts: Sequence[str] | None = None,
    image: Any = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    verify_tokens: int = 8,
    repeats: int = 5,
    gamma: int = 4,
    torch_threads: int | None = 1,
) -> Profile:
    """Measure every stage's latencies and every pair's acceptance (see the module docstring).

    `image`: for a VLM target (required there), a path, bytes, PIL image or data URL. `torch_threads`:
    those of one device (`pipespec.planning.placement.Devices.threads`), as each stage gets in a pipeline.
    """
    from pipespec.local import LocalPipeline

    if max_new_tokens <= verify_tokens:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must exceed verify_tokens ({verify_tokens})")
    config = source if isinstance(source, PipelineConfig) else load_config(source)
    picture, image_name = _image(config, image)
    prompts = tuple(prompts or (IMAGE_PROMPTS if picture is not None else TEXT_PROMPTS))
    pipeline = LocalPipeline(config, torch_threads=torch_threads)  # loads the stages; never started
    requests = [_request(pipeline, p, picture, max_new_tokens) for p in prompts]
    with pinned(torch_threads) if torch_threads else nullcontext():  # as a device actor is (pipespec.cluster.cores)
        stages = tuple(
            _profile_stage(pipeline.stages, i, config, requests[0], verify_tokens, repeats) for i in range(len(config.stages))
        )
        last = len(config.stages) - 1
        timed = _time_requests(config, last, pipeline.stages[-1], prompts, picture, max_new_tokens, torch_threads)
        stages = tuple(
            replace(s, step_s=_drafter_step_s(config, i, pipeline.stages[i], prompts, max_new_tokens, torch_threads))
            if i < last
            else s
            for i, s in enumerate(stages)
        )
        valid = pipeline.entrance.tokenizer_size
        pairs = tuple(
            _profile_pair(pipeline.stages, config, i, j, requests, gamma, valid)
            for i, j in itertools.combinations(range(len(config.stages)), 2)
        )
        return Profile(config.name, stages, pairs, prompts, image_name, max_new_tokens, gamma, torch_threads, timed)


def _time_requests(
    config: PipelineConfig,
    index: int,
    stage: Stage,
    prompts: Sequence[str],
    picture: Any,
    max_new_tokens: int,
    torch_threads: int | None,
) -> Requests:
    """The loaded stage `index` of `config` alone in the runtime, in this process: each prompt streamed, timed
    (`Requests`). ConfigError if that stage cannot run alone."""
    from pipespec.local import LocalPipeline

    alone = sub_config(config, [index])
    tokens, first_s, seconds = [], [], []
    with LocalPipeline(alone, stages=[stage], torch_threads=torch_threads) as pipeline:
        for prompt in prompts:
            start, first, count = time.perf_counter(), None, 0
            for delta in pipeline.stream(**request_keywords(alone, prompt, picture, max_new_tokens)):
                first = first or time.perf_counter() - start
                count += len(delta.token_ids)
            tokens.append(count)
            first_s.append(first or 0.0)
            seconds.append(time.perf_counter() - start)
    timed = Requests(tuple(tokens), tuple(first_s), tuple(seconds))
    log.info(
        "%s alone in the runtime: %.1f tok/s, %s tokens, first deltas %s ms",
        alone.target.name,
        timed.tokens_per_s,
        tokens,
        [round(f * 1e3) for f in first_s],
    )
    return timed


DRAFTER_ROUNDS = 5  # a drafter's step in the runtime is the median of this many rounds of the prompts: one round of
# a drafter's step besides its forward is small and noisy


def _drafter_step_s(
    config: PipelineConfig, index: int, stage: Stage, prompts: Sequence[str], max_new_tokens: int, torch_threads: int | None
) -> float | None:
    """The drafter `index` alone in the runtime on the prompts' text (`_time_requests`): its seconds per token after
    its first, the median of `DRAFTER_ROUNDS` rounds; None if it cannot run alone (a DREAM stage reads its verifier's
    features) or stopped at once."""
    try:
        rounds = [
            _time_requests(config, index, stage, prompts, None, max_new_tokens, torch_threads) for _ in range(DRAFTER_ROUNDS)
        ]
    except ConfigError as e:
        log.info("stage %s not timed alone in the runtime: %s", config.stages[index].name, e)
        return None
    steps = [r.step_s for r in rounds if r.step_s is not None]
    return statistics.median(steps) if steps else None


def _image(config: PipelineConfig, image: Any) -> tuple[Any, str | None]:
    """-> (the decoded picture or None, how to name it); a bad image or an image for a text target is a ValueError."""
    from pipespec.requests.images import load_image

    target = config.target
    takes_images = kind_of(target).takes_images
    if image is not None and not takes_images:
        raise ValueError(f"target stage {target.name!r} ({target.kind}) does not take images")
    if not takes_images:
        return None, None
    if image is None:
        raise ValueError(f"target stage {target.name!r} ({target.kind}) takes images: profile it with --image FILE")
    return load_image(image), str(image) if isinstance(image, (str, os.PathLike)) else type(image).__name__


def request_keywords(config: PipelineConfig, prompt: str, image: Any, max_new_tokens: int) -> dict[str, Any]:
    """A greedy request on `prompt` (and `image`, for a VLM target) as the front door and `Client.stream`
    take it. A chain that loads no model has no tokenizer: its prompt is the text's UTF-8 bytes modulo
    the target's vocabulary."""
    greedy = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    if not any(kind_of(s).loads_model for s in config.stages):
        vocab = config.target.options.vocab_size
        return {"prompt_token_ids": [b % vocab for b in prompt.encode()], **greedy}
    return {"prompt": prompt, "image": image, **greedy}


def _request(pipeline: Any, prompt: str, image: Any, max_new_tokens: int) -> RequestSpec:
    """A greedy request through the pipeline's front door (`request_keywords`)."""
    spec, _ = pipeline.request(**request_keywords(pipeline.config, prompt, image, max_new_tokens))
    return spec


def open_session(stage: Stage, target: Stage, spec: RequestSpec, reads_features: bool) -> Session:
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
        session.forward(fed, generated[:verify_tokens])[-1, 0].item()  # .item(): the device has finished it
        blocks.append(time.perf_counter() - start)
    return statistics.median(ones), statistics.median(blocks)


def _profile_stage(
    stages: Sequence[Stage], i: int, config: PipelineConfig, spec: RequestSpec, verify_tokens: int, repeats: int
) -> StageProfile:
    session = open_session(stages[i], stages[-1], spec, kind_of(config.stages[i]).reads_target_features)
    try:
        one_s, block_s = time_forwards(session, verify_tokens, repeats)
    finally:
        session.close()
    name = config.stages[i].name
    log.info("stage %s: %.2f ms a token, %.2f ms for %d", name, one_s * 1e3, block_s * 1e3, verify_tokens)
    return StageProfile(name, config.stages[i].kind, one_s, block_s, verify_tokens)


def _profile_pair(
    stages: Sequence[Stage],
    config: PipelineConfig,
    i: int,
    j: int,
    requests: Sequence[RequestSpec],
    gamma: int,
    valid: int | None,
) -> PairProfile:
    """Stage i drafting for stage j in the chain (i, j, ..., target) of `config`; skipped if that chain is invalid."""
    names = [s.name for s in config.stages]
    try:
        chain = sub_config(config, [i, *range(j, len(names))])
    except ConfigError as e:
        log.info("pair %s -> %s skipped: %s", names[i], names[j], e)
        return PairProfile(names[i], names[j], None, skipped=str(e))
    drafter = _drafter(stages[i], chain, stages[-1].vocab_size, valid)
    verifier = FeaturedVerifier(stages[j], stages[-1]) if kind_of(chain.stages[1]).reads_target_features else stages[j]
    total = PairStats(names[i], names[j])
    for spec in requests:
        total.merge(generate_sync(verifier, spec, drafter, gamma).pair)
    log.info("pair %s -> %s: alpha %.3f over %d drafts", names[i], names[j], total.token_acceptance, total.num_draft_tokens)
    temperature = None
    if j == len(names) - 1:  # the target: what the drafter's trees would be worth to it
        temperature = value_temperature(drafter, stages[j], requests, kind_of(chain.stages[0]).reads_target_features)
        log.info("pair %s -> %s: value temperature %.2f", names[i], names[j], temperature)
    return PairProfile(
        names[i],
        names[j],
        total.token_acceptance,
        total.num_draft_tokens,
        total.num_accepted_tokens,
        total.mean_acceptance_length,
        temperature=temperature,
    )


def value_temperature(drafter: Stage, target: Stage, requests: Sequence[RequestSpec], reads_features: bool) -> float:
    """The drafter's logits at each token of the target's greedy answers to `requests`, one token a forward as it
    drafts them (one that `reads_features`, a DREAM drafter: fed the target's features of everything before, as a
    FeaturedVerifier) -> their calibration for draft trees (pipespec.engine.tree_drafting.fit_temperature)."""
    drafter = FeaturedVerifier(drafter, target) if reads_features else drafter
    logits, tokens = [], []
    for spec in requests:
        answer = generate_sync(target, spec).token_ids
        session = drafter.open(spec)
        try:
            fed, previous = session.prompt_len - 1, [session.last_prompt_token, *answer]
            logits += [session.forward(fed + k, [previous[k]])[-1] for k in range(len(answer))]
        finally:
            session.close()
        tokens += answer
    return fit_temperature(torch.stack(logits), tokens)


def _drafter(loaded: Stage, chain: PipelineConfig, width: int, valid: int | None) -> Stage:
    """The drafter of the chain's first link: a mock is rebuilt for this chain (its agreement is with the
    stage after it); any other stage does not depend on its chain, so the loaded one serves."""
    if not kind_of(chain.stages[0]).depends_on_chain:
        return loaded
    from pipespec.stages.build import build_stage

    return build_stage(chain.stages[0], chain.stages, width, valid)
