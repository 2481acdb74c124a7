"""One vocabulary for the whole pipeline, however each model pads its embedding table.

Stages share the target's tokenizer, but checkpoints pad their embedding tables differently (Qwen2.5-VL
and Qwen2.5 have the same 151,665 tokens and different table sizes). Every stage's logits are made
`width` wide (the target's table) and the ids the tokenizer lacks (`valid` and up: padding rows that
no text maps to) are masked to -inf, in every stage including the target, so all stages choose from
the same distribution support. A model with fewer rows than the tokenizer has tokens is a config error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipespec.errors import ConfigError


@dataclass(frozen=True)
class LogitsFit:
    """How one stage's [n, own] logits become the pipeline's [n, width]."""

    own: int  # rows of the stage's LM head
    width: int  # the target's
    valid: int  # ids below this are tokens of the shared tokenizer

    @classmethod
    def of(cls, stage: str, own: int, width: int | None, valid: int | None) -> LogitsFit:
        width = own if width is None else width
        valid = width if valid is None else min(valid, width)
        if own < valid:
            raise ConfigError(
                f"stage {stage!r}: its LM head has {own} rows but the shared tokenizer has {valid} tokens "
                f"(target vocabulary width {width}); this model cannot score every token"
            )
        return cls(own, width, valid)

    @property
    def identity(self) -> bool:
        return self.own == self.width == self.valid

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, own] -> [n, width], ids >= valid at -inf."""
        if self.identity:
            return logits
        out = logits.new_full((logits.shape[0], self.width), float("-inf"))
        out[:, : self.valid] = logits[:, : self.valid]
        return out
