"""Building a config's stages: each kind's builder by name, `build_stage`, `load_stages`, `check_vocabularies`.

A stage of a kind is built by its own class, from its `StageSpec` and a `BuildContext`; `BUILDERS`
maps each name of the table of kinds (`pipespec.stages.kinds`) to that builder, which imports the
kind's module (and torch) only when a stage of that kind is built, so importing this module stays
torch-free. A kind that runs a model computes on its spec's `device` (its stage class resolves it
through `pipespec.stages.device`); mock and ngram stages compute on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from pipespec.errors import ConfigError
from pipespec.stages.build_context import BuildContext
from pipespec.stages.kinds import kind_of

if TYPE_CHECKING:
    from pipespec.config import PipelineConfig, StageSpec
    from pipespec.engine.stage import Stage


def _causal_lm(spec: StageSpec, at: BuildContext) -> Stage:
    from pipespec.stages.causal_lm import CausalLMStage

    return CausalLMStage(spec, at)


def _ngram(spec: StageSpec, at: BuildContext) -> Stage:
    from pipespec.stages.ngram import NgramStage

    return NgramStage(spec, at)


def _dream(spec: StageSpec, at: BuildContext) -> Stage:
    from pipespec.stages.dream.stage import DreamStage

    return DreamStage.from_spec(spec, at)


def _vlm(spec: StageSpec, at: BuildContext) -> Stage:
    from pipespec.stages.vlm import VLMStage

    return VLMStage(spec, at)


def _mock(spec: StageSpec, at: BuildContext) -> Stage:
    from pipespec.stages.mock import MockStage

    return MockStage(spec, at)


BUILDERS: Mapping[str, Callable[[StageSpec, BuildContext], Stage]] = {
    "causal_lm": _causal_lm,
    "ngram": _ngram,
    "dream": _dream,
    "vlm": _vlm,
    "mock": _mock,
}  # one per name of pipespec.stages.kinds.KINDS


def build_stage(
    spec: StageSpec,
    chain: Sequence[StageSpec],
    width: int | None = None,
    valid: int | None = None,
    sends_features: bool = False,
) -> Stage:
    """Build the stage `spec`; `chain` is the stages from it down to the target (inclusive).

    `width`: the target's vocabulary (logits per row), None when building the target itself;
    `valid`: the shared tokenizer's size, None without one (see pipespec.stages.vocabulary);
    `sends_features`: its drafter reads its features (`PipelineConfig.sends_features`).
    """
    kind_of(spec)  # a ConfigError naming a kind the table lacks
    return BUILDERS[spec.kind](spec, BuildContext(tuple(chain), width, valid, sends_features))


def load_stages(config: PipelineConfig, valid: int | None = None) -> list[Stage]:
    """Build every stage of `config`, target first, and check their vocabularies line up."""
    specs = config.stages
    target = build_stage(specs[-1], specs[-1:], None, valid, config.sends_features(len(specs) - 1))
    built = [target]
    for i in range(len(specs) - 2, -1, -1):
        built.append(build_stage(specs[i], specs[i:], target.vocab_size, valid))
    built.reverse()
    check_vocabularies(specs, [s.vocab_size for s in built])
    return built


def check_vocabularies(specs: Sequence[StageSpec], vocab_sizes: Sequence[int]) -> None:
    """Every stage's logits must cover exactly the target's vocabulary."""
    target = vocab_sizes[-1]
    for spec, size in zip(specs, vocab_sizes):
        if size != target:
            raise ConfigError(
                f"stage {spec.name!r}: vocabulary of {size} logits differs from the target "
                f"{specs[-1].name!r} ({target}); stages must share the target's vocabulary"
            )
