"""Stage kinds, one module each, and `load_stages`: a config's stages, built through the registry of kinds.

Torch-free and free of `pipespec.config` at import (the config imports `pipespec.stages.registry`,
which loads this package first): a kind's class, and torch, load when a stage of that kind is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipespec.errors import ConfigError
from pipespec.stages.registry import BuildContext, kind_of

if TYPE_CHECKING:
    from pipespec.config import PipelineConfig, StageSpec
    from pipespec.engine.stage import Stage


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
    return kind_of(spec).build(spec, BuildContext(tuple(chain), width, valid, sends_features))


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
