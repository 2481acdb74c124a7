"""Mock stages: deterministic toy models with a tunable agreement rate and an emulated latency.

Labelled as what they are: *not* real models. They exist for protocol tests (rollback storms at
chosen agreement rates) and for scaling experiments past the hardware at hand (per-forward latencies
of, say, 1B / 8B / 70B models). Their "KV cache" is the list of context tokens, held to the same
length invariant as a real cache, so rollback bugs show up here first.

The world: at context index t with previous tokens (a, b), the stage `level` hops above the target
agrees with the level below with probability `agreement` (a hash of (a, b, t, level) decides); the
first level that disagrees produces its own random logits, with the level below's token ranked second
there with probability `runner_up` (another hash). Level 0 (the target) always produces its own. So
the mock at level d reproduces the target's logits exactly where the whole chain agrees.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipespec.engine import noise
from pipespec.engine.stage import check_keep, check_length
from pipespec.protocol.messages import RequestSpec
from pipespec.stages.build_context import ALONE, BuildContext
from pipespec.stages.kinds import MockOptions

if TYPE_CHECKING:
    from pipespec.config import StageSpec


class MockStage:
    max_context: int | None = None  # no limit on the context

    def __init__(self, spec: StageSpec, at: BuildContext = ALONE):
        """The mock `spec`, emulating its agreement with the stages of `at.chain` after it (alone: the target)."""
        self.name = spec.name
        chain = [s.options if s.options is not None else MockOptions() for s in at.chain or (spec,)]
        self.chain = tuple(chain)  # chain[0] is this stage's options, chain[-1] the target's (levels d .. 0)
        self.options = chain[0]
        self.vocab_size = self.options.vocab_size
        self.world_seed = chain[-1].seed
        self.eos_token_ids = frozenset() if chain[-1].eos_token_id is None else frozenset({chain[-1].eos_token_id})
        self._ids = np.arange(self.vocab_size, dtype=np.int64)

    def open(self, request: RequestSpec) -> MockSession:
        session = MockSession(self, request.text_prompt)
        self.sleep(len(session.context))
        return session

    def sleep(self, fed: int) -> None:
        delay = (self.options.latency_ms + self.options.per_token_ms * fed) / 1000.0
        if delay > 0:
            time.sleep(delay)

    def row(self, prev2: int, prev1: int, index: int) -> torch.Tensor:
        """[V] float32 logits for context index `index` after tokens (prev2, prev1)."""
        context = noise.mix32((prev2 + 1) * 0x10001 ^ noise.mix32(prev1 + 1))
        return torch.from_numpy(self._row(0, context, index))

    def _row(self, hop: int, context: int, index: int) -> np.ndarray:
        """The logits of the stage `hop` hops after this one in the chain (0: this one)."""
        options, level = self.chain[hop], len(self.chain) - 1 - hop
        if level == 0:
            return self._own(level, context, index)
        if noise.scalar_uniform(self.world_seed, index, context ^ (level << 24) ^ 0xA5) < options.agreement:
            return self._row(hop + 1, context, index)
        own = self._own(level, context, index)
        if options.runner_up and noise.scalar_uniform(self.world_seed, index, context ^ (level << 24) ^ 0x5A) < options.runner_up:
            theirs = int(self._row(hop + 1, context, index).argmax())
            top = int(own.argmax())
            if theirs != top:  # their token just under our choice
                runner = np.partition(own, -2)[-2]
                own[theirs] = runner + 0.5 * (own[top] - runner)
        return own

    def _own(self, level: int, context: int, index: int) -> np.ndarray:
        """[V] float32: level `level`'s own random logits (Gumbel-shaped, `scale` wide)."""
        k1, k2 = noise.counter_key(self.world_seed + level * 7919, index, context)
        h = noise.mix32(noise.mix32(self._ids ^ k1) ^ k2)  # numpy: cheaper than torch at this size
        u = (h.astype(np.float64) + 0.5) * (1.0 / (1 << 32))
        return (-self.chain[0].scale * np.log(-np.log(u))).astype(np.float32)


class MockSession:
    def __init__(self, stage: MockStage, prompt: Sequence[int]):
        self.stage = stage
        self.context = list(prompt[:-1])  # the emulated KV cache: context tokens fed so far
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        check_keep(self.stage.name, keep, len(self.context))
        del self.context[keep:]
        self.context.extend(tokens)
        check_length(self.stage.name, len(self.context), keep + len(tokens))
        rows = []
        for i in range(keep, keep + len(tokens)):
            prev2 = self.context[i - 1] if i >= 1 else -1
            rows.append(self.stage.row(prev2, self.context[i], i + 1))
        self.stage.sleep(len(tokens))
        return torch.stack(rows)

    def close(self) -> None:
        self.context = []
