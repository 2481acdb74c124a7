"""Mock stages: deterministic toy models with a tunable agreement rate and an emulated latency.

Labelled as what they are: *not* real models. They exist for protocol tests (rollback storms at
chosen agreement rates) and for scaling experiments past the hardware at hand (per-forward latencies
of, say, 1B / 8B / 70B models): a forward lasts its emulated latency, the arithmetic of its logits
included, and a tree of lines costs one forward, as on a GPU (pipespec.engine.stage.TreeSession), as do
the forwards of several requests in one batch (`forward_batch`: the latency once, `per_token_ms` for every
row; pipespec.engine.stage.BatchingStage). Their
"KV cache" is the list of context tokens, held to the same length invariant as a real cache, so rollback
bugs show up here first.

The world: at context index t with previous tokens (a, b), the stage `level` hops above the target
agrees with the level below with probability `agreement` (a hash of (a, b, t, level) decides); the
first level that disagrees produces its own random logits, with the level below's token ranked second
there with probability `runner_up` and third with probability `third` (another hash). Level 0 (the
target) always produces its own. So the mock at level d reproduces the target's logits exactly where
the whole chain agrees.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipespec.engine import noise
from pipespec.engine.draft_tree import DraftTree
from pipespec.engine.stage import NO_SIDES, Feed, TreeNodes, check_keep, check_length
from pipespec.protocol.messages import RequestSpec
from pipespec.schema.kinds import MockOptions
from pipespec.stages.build_context import ALONE, BuildContext

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
        self._batch: list[int] | None = None  # inside `one_forward`: the tokens its forwards fed so far

    def forward_batch(self, feeds: Sequence[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each feed's `forward_tree` (or `forward_nodes`), all of them one emulated forward
        (pipespec.engine.stage.BatchingStage)."""
        with self.one_forward():
            return [
                (f.session.forward_nodes(f.keep, f.tokens, f.nodes), NO_SIDES)
                if f.nodes
                else f.session.forward_tree(f.keep, f.tokens, f.sides)
                for f in feeds
            ]

    def forward_rows(self, rows: int) -> int:
        return rows  # no padding: every row costs `per_token_ms`

    @contextmanager
    def one_forward(self) -> Iterator[None]:
        """The forwards inside are one emulated forward (on the compute thread: one batch at a time): each does
        its arithmetic, and the batch sleeps once, for the latency and every token they fed."""
        if self._batch is not None:
            raise RuntimeError(f"mock {self.name!r}: one_forward inside one_forward")
        began, self._batch = time.perf_counter(), [0]
        try:
            yield
        except BaseException:
            self._batch = None  # a failed forward: nothing to sleep out
            raise
        fed, self._batch = self._batch[0], None
        self.sleep(fed, began)

    def open(self, request: RequestSpec) -> MockSession:
        began = time.perf_counter()
        session = MockSession(self, request.text_prompt)
        self.sleep(len(session.context), began)
        return session

    def sleep(self, fed: int, began: float) -> None:
        """Sleep out the emulated forward that began at `began` (perf_counter) and fed `fed` tokens: the
        emulated device's time is its latency, the arithmetic that stands in for the model's included; inside
        `one_forward`, the batch's sleep pays for it."""
        if self._batch is not None:
            self._batch[0] += fed
            return
        delay = (self.options.latency_ms + self.options.per_token_ms * fed) / 1000.0 - (time.perf_counter() - began)
        if delay > 0:
            time.sleep(delay)

    def row(self, prev2: int, prev1: int, index: int) -> torch.Tensor:
        """[V] float32 logits for context index `index` after tokens (prev2, prev1)."""
        return self.rows([(prev2, prev1, index)])[0]

    def rows(self, keys: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """[len(keys), V] float32: `row` of each (prev2, prev1, index), the levels' own logits drawn together."""
        recipes = [self._recipe(0, noise.mix32((p2 + 1) * 0x10001 ^ noise.mix32(p1 + 1)), i) for p2, p1, i in keys]
        owns = self._owns(list(dict.fromkeys(key for recipe in recipes for key in _own_keys(recipe))))
        return torch.from_numpy(np.stack([self._cook(recipe, owns) for recipe in recipes]))

    def _recipe(self, hop: int, context: int, index: int) -> Recipe:
        """How the row of the stage `hop` hops after this one in the chain (0: this one) is made."""
        options, level = self.chain[hop], len(self.chain) - 1 - hop
        if level == 0:
            return (level, context, index), 0, None
        if noise.scalar_uniform(self.world_seed, index, context ^ (level << 24) ^ 0xA5) < options.agreement:
            return self._recipe(hop + 1, context, index)
        rank = 0  # where their token ranks in ours (0: wherever our own logits put it)
        if options.runner_up or options.third:
            u = noise.scalar_uniform(self.world_seed, index, context ^ (level << 24) ^ 0x5A)
            rank = 2 if u < options.runner_up else 3 if u < options.runner_up + options.third else 0
        return (level, context, index), rank, self._recipe(hop + 1, context, index) if rank else None

    def _cook(self, recipe: Recipe, owns: dict[tuple[int, int, int], np.ndarray]) -> np.ndarray:
        """The row `recipe` says, from the own logits `owns` (not changed)."""
        key, rank, below = recipe
        if below is None:
            return owns[key]
        own = owns[key].copy()
        theirs, top = int(self._cook(below, owns).argmax()), int(own.argmax())
        if theirs != top:  # their token just under our (rank - 1)th
            over, under = np.partition(own, (-rank, -rank + 1))[[-rank + 1, -rank]]
            own[theirs] = under + 0.5 * (over - under)
        return own

    def _owns(self, keys: Sequence[tuple[int, int, int]]) -> dict[tuple[int, int, int], np.ndarray]:
        """Each (level, context, index) -> [V] float32: that level's own random logits (Gumbel-shaped, `scale`
        wide), all in one pass (numpy: cheaper than torch at this size)."""
        k = np.array(
            [noise.counter_key(self.world_seed + level * 7919, index, context) for level, context, index in keys]
        )  # [K, 2]
        h = noise.mix32(noise.mix32(self._ids[None, :] ^ k[:, :1]) ^ k[:, 1:])  # [K, V]
        u = (h.astype(np.float64) + 0.5) * (1.0 / (1 << 32))
        return dict(zip(keys, (-self.chain[0].scale * np.log(-np.log(u))).astype(np.float32)))


# (own logits' (level, context, index), where the row below's token ranks in ours, the row below or None)
Recipe = tuple[tuple[int, int, int], int, "Recipe | None"]


def _own_keys(recipe: Recipe) -> list[tuple[int, int, int]]:
    key, _, below = recipe
    return [key] + (_own_keys(below) if below is not None else [])


def _key(line: Sequence[int], i: int, index: int) -> tuple[int, int, int]:
    """`MockStage.rows`' key of the row after line[i], which sits at context index `index`."""
    return (line[i - 1] if index >= 1 else -1), line[i], index + 1


class MockSession:
    def __init__(self, stage: MockStage, prompt: Sequence[int]):
        self.stage = stage
        self.context = list(prompt[:-1])  # the emulated KV cache: context tokens fed so far
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]
        self._tree: DraftTree | None = None  # the last tree fed (`forward_nodes`), whose path `keep_path` keeps

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        return self.forward_tree(keep, tokens, ())[0]

    def forward_tree(
        self, keep: int, tokens: Sequence[int], sides: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sleep for the main line and its sides: an emulated device runs a tree of lines as one forward
        (pipespec.engine.stage.TreeSession), paying `per_token_ms` for every token fed."""
        began = time.perf_counter()
        check_keep(self.stage.name, keep, len(self.context))
        keys = []
        for base, side in sides:  # on the cache before this forward writes past keep (base <= keep)
            check_keep(self.stage.name, base, keep)
            line = self.context[max(base - 2, 0) : base] + list(side)  # the side's last two context tokens at least
            keys.append(_key(line, len(line) - 1, base + len(side) - 1))
        del self.context[keep:]
        self.context.extend(tokens)
        check_length(self.stage.name, len(self.context), keep + len(tokens))
        keys += [_key(self.context, i, i) for i in range(keep, keep + len(tokens))]
        rows = self.stage.rows(keys)  # [S + n, V]
        self.stage.sleep(len(tokens) + sum(len(side) for _, side in sides), began)
        return rows[len(sides) :], rows[: len(sides)]

    def forward_nodes(self, keep: int, line: Sequence[int], nodes: TreeNodes) -> torch.Tensor:
        """`forward(keep, line)` and a draft tree's nodes after it, one emulated forward paying `per_token_ms` for
        every row (pipespec.engine.stage.DraftTreeSession): a node's row is the one after its path."""
        began = time.perf_counter()
        check_keep(self.stage.name, keep, len(self.context))
        del self.context[keep:]
        self.context.extend(line)
        keys = [_key(self.context, i, i) for i in range(keep, keep + len(line))]
        tree = self._tree = nodes.tree
        for node in nodes.fed:
            path = self.context[-1:] + [tree.tokens[n] for n in tree.path(node)]  # the root, then the path
            keys.append(_key(path, len(path) - 1, len(self.context) + tree.depths[node] - 1))
        rows = self.stage.rows(keys)  # [len(line) + fed, V]
        self.stage.sleep(len(keys), began)
        return rows

    def keep_path(self, at: int, path: Sequence[int]) -> None:
        check_length(self.stage.name, len(self.context), at)
        self.context.extend(self._tree.tokens[n] for n in path)

    def close(self) -> None:
        self.context = []
