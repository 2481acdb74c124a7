"""What building one stage needs besides its own spec: where it sits in its chain and the pipeline's vocabulary.

Every stage class is built from its `StageSpec` and a `BuildContext` (`CausalLMStage(spec, at)`, ...);
`pipespec.stages.build` makes the context from a config, and a stage built on its own takes `ALONE`.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipespec.config import StageSpec


@dataclass(frozen=True)
class BuildContext:
    """Where a stage sits and the vocabulary it must fit (see pipespec.stages.vocabulary)."""

    chain: Sequence[StageSpec] = ()  # the specs from this stage's down to the target's (inclusive); () for a stage alone
    width: int | None = None  # the target's vocabulary (logits per row); None when building the target (or a stage alone)
    valid: int | None = None  # the shared tokenizer's size; None without one (every row is a token)
    sends_features: bool = False  # its drafter reads its features (pipespec.engine.handoff)


ALONE = BuildContext()  # a stage on its own: its own vocabulary, nobody after it, no drafter reading its features
