"""Building a config's stages: each kind's builder by name, `build_stage`, `load_stages`, `check_vocabularies`.

A stage of a kind is built by its own class, from its `StageSpec` and a `BuildContext`; `BUILDERS`
maps each name of the table of kinds (`pipespec.schema.kinds`) to that builder, which imports the
kind's module (`MODULES`; and torch) only when a stage of that kind is built or `prepare`d, so
importing this module stays torch-free. A kind that runs a model computes on its spec's `device` (its
stage class resolves it through `pipespec.stages.device`); mock, ngram and stand stages compute on the CPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from pipespec.errors import ConfigError
from pipespec.schema.kinds import kind_of
from pipespec.stages.build_context import BuildContext

if TYPE_CHECKING:
    from pipespec.config import PipelineConfig, StageSpec
    from pipespec.engine.stage import Stage


# each kind's module, imported (and torch with it) only when a stage of that kind is built or prepared
MODULES: Mapping[str, str] = {
    "causal_lm": "pipespec.stages.causal_lm",
    "ngram": "pipespec.stages.ngram",
    "stand": "pipespec.stages.stand",
    "dream": "pipespec.stages.dream.stage",
    "vlm": "pipespec.stages.vlm",
    "mock": "pipespec.stages.mock",
}  # one per name of pipespec.schema.kinds.KINDS


def _module(kind: str) -> ModuleType:
    """The module of the stage class of `kind`, imported (once)."""
    return importlib.import_module(MODULES[kind])


BUILDERS: Mapping[str, Callable[[StageSpec, BuildContext], Stage]] = {
    "causal_lm": lambda spec, at: _module("causal_lm").CausalLMStage(spec, at),
    "ngram": lambda spec, at: _module("ngram").NgramStage(spec, at),
    "stand": lambda spec, at: _module("stand").StandStage(spec, at),
    "dream": lambda spec, at: _module("dream").DreamStage.from_spec(spec, at),
    "vlm": lambda spec, at: _module("vlm").VLMStage(spec, at),
    "mock": lambda spec, at: _module("mock").MockStage(spec, at),
}  # one per name of MODULES


def prepare(specs: Iterable[StageSpec]) -> None:
    """Import what builds these stages (torch, transformers: seconds), ahead of building them."""
    for kind in {kind_of(spec).name for spec in specs}:
        _module(kind)


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
