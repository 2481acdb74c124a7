"""The STAND drafter: a weightless n-gram drafter that keeps the target's probabilities (Song et al., 2025).

STAND (stochastic adaptive n-gram drafting) proposes after a context the target's own next-token distribution
the last times it saw that context's suffix (`pipespec.stages.ngram_memory`): its `top_k` likeliest tokens with
their probabilities, as a row of logits (the log-probabilities, -inf elsewhere). So its first choice is the
target's most frequent one, its runner-ups are real (a `tree` section grows trees from them, Gumbel-top-k under
rejection sampling: pipespec.engine.tree_drafting), and its q is an exact distribution under every verify mode.
Where the memory knows no suffix it falls back to prompt lookup (pipespec.stages.ngram), then to uniform.

It learns from commits: the coordinator relays it every `Commit` of its requests, its target's `top_k`
likeliest tokens at each position with it (`CommitLearner`; the synchronous engine teaches it the same way).
One memory serves every request of the stage: what one answer taught helps the next.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pipespec.protocol.messages import Commit, RequestSpec
from pipespec.schema.kinds import StandOptions
from pipespec.stages.build_context import BuildContext
from pipespec.stages.ngram import NgramSession, drafting_width, lookup, one_hot
from pipespec.stages.ngram_memory import NgramMemory

if TYPE_CHECKING:
    from pipespec.config import StageSpec


class StandStage:
    def __init__(self, spec: StageSpec, at: BuildContext):
        """The drafter `spec` (its options, or the defaults), proposing over the target's vocabulary `at.width`."""
        self.name = spec.name
        self.options: StandOptions = spec.options if spec.options is not None else StandOptions()
        self.vocab_size = drafting_width(spec, at)
        opts = self.options
        self.memory = NgramMemory(opts.min_n, opts.max_n, opts.top_k, opts.max_contexts)
        self.learns_top = opts.top_k
        self._contexts: dict[str, list[int] | None] = {}  # request id -> its text prompt and committed tokens (None: lost)

    def open(self, request: RequestSpec) -> NgramSession:
        return NgramSession(self, request.text_prompt)

    def write_row(self, context: Sequence[int], row: torch.Tensor) -> None:
        top = self.memory.recall(context)
        if top is not None:
            row.fill_(float("-inf"))
            for token, p in top:
                if token < len(row):
                    row[token] = math.log(p)
        elif (proposal := lookup(context, self.options.min_n, self.options.max_n)) is not None:
            one_hot(row, proposal)

    def learn(self, request: RequestSpec, commit: Commit) -> None:
        rid = request.request_id
        if rid not in self._contexts:
            self._contexts[rid] = [*request.text_prompt, *request.committed]
        context = self._contexts[rid]
        if context is None:  # its commits were lost track of: learnt no more
            return
        generated = len(context) - len(request.text_prompt)
        if commit.start != generated:
            self._contexts[rid] = None
            raise ValueError(
                f"stage {self.name!r}: a commit of request {rid!r} at {commit.start}, after {generated} committed tokens"
            )
        for i, token in enumerate(commit.tokens):
            if commit.logprobs is not None:  # the target's likeliest there
                self.memory.teach(context, [(t, math.exp(lp)) for t, lp in commit.logprobs[i].top])
            else:  # what came, as certain
                self.memory.teach(context, [(token, 1.0)])
            context.append(token)

    def forget(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)
