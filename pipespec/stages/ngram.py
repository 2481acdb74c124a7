"""The n-gram (prompt lookup) drafter: no weights, proposes what followed the context's suffix before.

For each position it looks for the most recent earlier occurrence of the context's last n tokens
(n from max_n down to min_n) and proposes the token that followed it, as a one-hot row of logits
(0 for the proposal, -inf elsewhere). Without a match the row is uniform. Both are exact
distributions, so the drafter is valid under every verify mode (rejection ships the one-hot q).
`NgramSession` serves any drafter that writes a row from the context alone (pipespec.stages.stand too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from pipespec.engine.stage import check_keep, check_length
from pipespec.protocol.messages import RequestSpec
from pipespec.schema.kinds import NgramOptions
from pipespec.stages.build_context import BuildContext

if TYPE_CHECKING:
    from pipespec.config import StageSpec


def lookup(context: Sequence[int], min_n: int, max_n: int) -> int | None:
    """The token that followed the most recent earlier match of the context's last n tokens (the longest n of
    max_n .. min_n that matches), if any."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = list(context[-n:])
        for start in range(len(context) - n - 1, -1, -1):
            if context[start] == suffix[0] and list(context[start : start + n]) == suffix:
                return context[start + n]
    return None


def one_hot(row: torch.Tensor, token: int) -> None:
    """row [V] logits: all of the mass on `token`."""
    row.fill_(float("-inf"))
    row[token] = 0.0


class RowWriter(Protocol):
    """A weightless drafter: the logits it proposes after a context."""

    name: str
    vocab_size: int

    def write_row(self, context: Sequence[int], row: torch.Tensor) -> None:
        """Fill row [V] (zeros: uniform) with the logits proposed after `context`."""
        ...


def drafting_width(spec: StageSpec, at: BuildContext) -> int:
    """The vocabulary a weightless drafter proposes over: its target's (`at.width`), which it needs to be built."""
    if at.width is None:
        raise ValueError(f"stage {spec.name!r}: kind {spec.kind!r} only drafts; building it needs the target's vocabulary width")
    return at.width


class NgramStage:
    def __init__(self, spec: StageSpec, at: BuildContext):
        """The drafter `spec` (its options, or the defaults), proposing over the target's vocabulary `at.width`."""
        self.name = spec.name
        self.options: NgramOptions = spec.options if spec.options is not None else NgramOptions()
        self.vocab_size = drafting_width(spec, at)

    def open(self, request: RequestSpec) -> NgramSession:
        return NgramSession(self, request.text_prompt)

    def propose(self, context: Sequence[int]) -> int | None:
        """The token that followed the most recent earlier match of the context's suffix, if any."""
        return lookup(context, self.options.min_n, self.options.max_n)

    def write_row(self, context: Sequence[int], row: torch.Tensor) -> None:
        proposal = self.propose(context)
        if proposal is not None:
            one_hot(row, proposal)


class NgramSession:
    """A weightless drafter's session: the context it was fed, and a row per fed token from its `RowWriter`."""

    def __init__(self, stage: RowWriter, prompt: Sequence[int]):
        self.stage = stage
        self.context = list(prompt[:-1])
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        check_keep(self.stage.name, keep, len(self.context))
        del self.context[keep:]
        rows = torch.zeros(len(tokens), self.stage.vocab_size)
        for i, token in enumerate(tokens):
            self.context.append(token)
            self.stage.write_row(self.context, rows[i])
        check_length(self.stage.name, len(self.context), keep + len(tokens))
        return rows

    def close(self) -> None:
        self.context = []
