"""Stage kinds, one file each, and `load_stages`, the one place a config's `kind` picks a class."""

from __future__ import annotations

from collections.abc import Sequence

from pipespec.config import ConfigError, PipelineConfig, StageSpec
from pipespec.stage import Stage


def build_stage(
    spec: StageSpec,
    chain: Sequence[StageSpec],
    width: int | None = None,
    valid: int | None = None,
    feeds_dream: bool = False,
) -> Stage:
    """Build the stage `spec`; `chain` is the stages from it down to the target (inclusive).

    `width`: the target's vocabulary (logits per row), None when building the target itself;
    `valid`: the shared tokenizer's size, None without one (see pipespec.stages.vocabulary);
    `feeds_dream`: its drafter is a DREAM stage (a VLM then also computes its image attention).
    """
    if spec.kind == "causal_lm":
        from pipespec.stages.causal_lm import CausalLMStage

        return CausalLMStage(spec.name, spec.model, spec.dtype, spec.device, width, valid)
    if spec.kind == "vlm":
        from pipespec.stages.vlm import VLMStage

        return VLMStage(spec.name, spec.model, spec.dtype, spec.device, width, valid, image_attention=feeds_dream)
    if spec.kind == "dream":
        from pipespec.stages.dream.stage import DreamStage

        return DreamStage.load(spec.name, spec.model, spec.dtype, spec.device, width, valid)
    if spec.kind == "mock":
        from pipespec.stages.mock import MockStage

        return MockStage(spec.name, [s.options for s in chain])
    if spec.kind == "ngram":
        from pipespec.stages.ngram import NgramStage

        assert width is not None
        return NgramStage(spec.name, spec.options, width)
    raise ConfigError(f"stage {spec.name!r}: kind {spec.kind!r} is not available in this build yet")


def load_stages(config: PipelineConfig, valid: int | None = None) -> list[Stage]:
    """Build every stage of `config`, target first, and check their vocabularies line up."""
    specs = config.stages
    target = build_stage(specs[-1], specs[-1:], None, valid, feeds_dream=len(specs) > 1 and specs[-2].kind == "dream")
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
