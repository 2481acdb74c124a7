"""How a Hugging Face stage runs its decode and verification forwards: every request's feed packed into one.

Each request's feed is cut into pieces of at most `max_width` tokens, and one forward carries the next
piece of every request given (pipespec.stages.packing): their tokens, each at its own positions, then
rows of no request up to the forward's row bucket: a power of two, or from 24 up also the halfway
3 x 2^k (a 16-request verification of 80 rows pads to 96, not 128), from the stage's least width (pipespec.stages.forwards.least_width) to `max_batch` x `max_width`. A feed of more than one piece (a
long rollback's catch-up) takes one forward per piece, the other requests riding along in the first.
Prompts go in by chunks (`prefill`: pipespec.engine.stage.ChunkedPrefillStage), several requests' in one eager
forward of their input embeddings, between those forwards.

What keeps a request's logits what they are alone (measured on this CPU: dev/batch_invariance.py,
tests/test_packed_forwards.py): a matrix product's row depends on the row count only below 4 rows, and
a target's forward has at least 4 (its least width: the smallest bucket); attention is per request, over
its own cache, with at least as many query rows as that least width (a short piece's last query
repeated), where a query row no longer depends on how many there are. Only the target needs it: a
drafter's least width is 1 (its logits pick drafts, never the answer).

Compiled, a graph depends only on the row bucket: every bucket is compiled when the stage starts
(`warm_up`). On a GPU a forward of one request replays the CUDA graph of its cache and bucket
(pipespec.stages.cuda_graphs; there the least width is `max_width`, the kernels changing with the row
count), and a forward of several runs compiled, unreplayed: on a GPU a request's logits are promised
the same only between forwards of one request.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipespec.engine.stage import Feed, TreeNodes, check_keep, check_length
from pipespec.stages.cuda_graphs import GraphedStep
from pipespec.stages.forwards import _GRAPHS, MOST_GRAPHS, Shapes, _without_registry_guards
from pipespec.stages.invariance import NONE_NEEDED, Invariance
from pipespec.stages.kv_pool import KVPool
from pipespec.stages.packing import Packing, Piece, TreeRows, packed
from pipespec.stages.static_kv import StaticKV

log = logging.getLogger(__name__)

# One packed forward: (ids [1, T], rotary positions [1, T]) -> outputs [1, T, ...] each.
PackedStep = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class CacheFeed:
    """What one request's forward feeds: `tokens` after the first `keep` entries of `cache`. Its rows' rotary
    positions are their cache positions plus `shift` (a multimodal rotary model's offset after an image)."""

    cache: StaticKV
    keep: int
    tokens: Sequence[int]
    shift: int = 0
    nodes: TreeNodes | None = None  # draft-tree nodes fed after `tokens`, in the same piece (pipespec.engine.stage)

    def end(self, gap: int) -> int:
        """The cache slots it writes before: its tokens' and, `gap` past them, its tree nodes' (`rows`)."""
        return self.keep + len(self.tokens) + (gap + max(self.nodes.fed) + 1 if self.nodes else 0)

    def rows(self, start: int, length: int, gap: int) -> tuple[list[int], list[int], list[int]]:
        """The ids, cache slots and rotary positions of its piece of `length` tokens from `start` (a tree feed: its
        one piece, the line's tokens then its nodes', node i's keys at slot keep + len(tokens) + gap + i, its
        position the one after its parent's: pipespec.stages.packing.TreeRows)."""
        at = self.keep + start
        ids, slots = list(self.tokens[start : start + length]), list(range(at, at + length))
        rotary = [slot + self.shift for slot in slots]
        if self.nodes is not None:
            base, tree = self.keep + len(self.tokens), self.nodes.tree
            ids += [tree.tokens[n] for n in self.nodes.fed]
            slots += [base + gap + n for n in self.nodes.fed]
            rotary += [base + tree.depths[n] - 1 + self.shift for n in self.nodes.fed]
        return ids, slots, rotary


class PackedForwards:
    """A stage's forwards over many requests at once: `step` at fixed row buckets, eager or compiled."""

    def __init__(
        self,
        stage: str,
        step: PackedStep,
        shapes: Shapes,
        max_batch: int,
        compiled: bool,
        device: torch.device,
        lock: threading.RLock,
        invariance: Invariance = NONE_NEEDED,
    ):
        """`lock`: the model's, held by each forward (pipespec.stages.packing.use_packed_attention); `invariance`: the
        rows a forward and the query rows an attention need on this device (pipespec.stages.invariance)."""
        self.stage = stage
        self.lock = lock
        self.shapes = shapes
        self.compiled = compiled
        self.warmup_s = 0.0
        self.least = shapes.widths[0]  # a piece's attention runs over at least this many query rows
        self.invariance = invariance
        self.rows = max(self.least, invariance.rows)  # a forward's least rows
        widest = max(max_batch * shapes.widths[-1], self.rows)
        steps = {2**i for i in range(widest.bit_length())} | {3 * 2**i for i in range(3, widest.bit_length())}
        self.buckets = tuple(sorted(b for b in steps if self.rows <= b <= widest))
        if compiled:  # every stage's buckets are graphs of one function (a stage kind's `_step`): room for all of them
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MOST_GRAPHS)
            step = torch.compile(_own_code(step, stage), dynamic=False, options={"guard_filter_fn": _without_registry_guards})
        self.step = step
        # on a GPU, a forward of one request replays the CUDA graph of its cache and width (captured over the
        # positions tensor: any positions); a forward of several runs compiled, unreplayed
        self.graphs = GraphedStep(self._alone) if compiled and device.type == "cuda" else None

    def run(self, feeds: Sequence[Feed], shifts: Sequence[int] | None = None) -> list[tuple[torch.Tensor, ...]]:
        """A model stage's `forward_batch` (pipespec.engine.stage.BatchingStage) over sessions that hold a `cache`:
        each keep checked against its cache, the packed forward (`shifts`: each request's rotary offset), each
        cache's length checked after it. -> per feed, each output of `step` for its real rows [n, ...]."""
        for f in feeds:
            check_keep(self.stage, f.keep, f.session.cache.length)
            if f.sides:
                raise ValueError(f"stage {self.stage!r}: a model stage grows no side lines (not a TreeSession)")
        shifts = shifts or [0] * len(feeds)
        outs = self(
            [
                CacheFeed(f.session.cache, f.keep, f.tokens, shift, f.nodes if f.nodes and f.nodes.fed else None)
                for f, shift in zip(feeds, shifts)
            ]
        )
        for f in feeds:
            check_length(self.stage, f.session.cache.length, f.keep + len(f.tokens))
        return outs

    @torch.inference_mode()
    def __call__(self, feeds: Sequence[CacheFeed]) -> list[tuple[torch.Tensor, ...]]:
        """Run every feed; -> per feed, each output of `step` for its real rows [n, ...]."""
        for feed in feeds:
            self._check_room(feed.cache, feed.keep + len(feed.tokens), feed.end(self.tree_gap))
        cuts = [self._cut(feed) for feed in feeds]
        parts: list[list[list[torch.Tensor]]] = [[] for _ in feeds]
        for round_ in range(max(map(len, cuts))):
            riders = [i for i, pieces in enumerate(cuts) if round_ < len(pieces)]
            with self.lock:
                outs, spans = self._forward([(feeds[i], cuts[i][round_]) for i in riders])
            for i, (offset, length) in zip(riders, spans):
                parts[i].append([out[0, offset : offset + length] for out in outs])
        for feed in feeds:
            feed.cache.rewind(feed.keep + len(feed.tokens))
        return [tuple(p[0] if len(p) == 1 else torch.cat(p) for p in zip(*pieces)) for pieces in parts]

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[tuple[StaticKV, torch.Tensor]], decoder: torch.nn.Module) -> list[torch.Tensor]:
        """One eager forward of prompt chunks: each (cache, its next prompt tokens' input embeddings [n, H]) fed after
        what its cache holds, at those positions, the forward padded to at least the least width (a prompt's
        length changes with every request: not compiled) of the model's `decoder` (its language model, no head).
        -> per chunk, its rows' post-norm hidden states [n, H]."""
        pieces, positions, ends = [], [], []
        for cache, embeds in chunks:
            at = cache.length
            self._check_room(cache, at + len(embeds))
            pieces.append(Piece(cache, len(positions), len(embeds)))
            positions += range(at, at + len(embeds))
            ends.append(at + len(embeds))
        embeds = torch.cat([e for _, e in chunks])  # [T, H]
        pad = max(0, self.rows - len(positions))  # rows of no request: a product's row depends on the count below it
        positions += range(positions[-1] + 1, positions[-1] + 1 + pad)
        embeds = torch.cat([embeds, embeds[-1:].expand(pad, -1)]) if pad else embeds
        positions_t = torch.tensor([positions], dtype=torch.long, device=embeds.device)  # [1, T]
        with self.lock, packed(self._packing(pieces, positions_t)):
            hidden = decoder(inputs_embeds=embeds[None], position_ids=positions_t, use_cache=False).last_hidden_state
        for (cache, _), end in zip(chunks, ends):
            cache.rewind(end)
        return [hidden[0, piece.rows] for piece in pieces]

    @property
    def tree_gap(self) -> int:
        """Room after a tree's root for one path, where its groups attend; the tree's nodes are kept past it."""
        return self.shapes.widths[-1]

    def _cut(self, feed: CacheFeed) -> list[tuple[int, int, int]]:
        """-> (start, length, width) of each piece of `feed`'s tokens; a tree feed is one piece, its line and nodes."""
        if feed.nodes is None:
            return self.shapes.pieces(len(feed.tokens))
        rows, widest = len(feed.tokens) + len(feed.nodes.fed), self.shapes.widths[-1]
        if rows > widest:
            raise ValueError(f"stage {self.stage!r}: a tree forward of {rows} rows exceeds its max_width of {widest}")
        return [(0, len(feed.tokens), rows)]

    def _check_room(self, cache: StaticKV, end: int, slots: int | None = None) -> None:
        """A ValueError naming the limit unless a request's context may reach `end` tokens in `cache` (and a forward
        write its first `slots`: a tree's nodes past its context)."""
        self.shapes.check_context(self.stage, end)
        if max(end, slots or 0) + self.shapes.widths[-1] > cache.capacity:  # room for a one-request forward's padding
            what = (
                f"{end} context tokens"
                if end >= (slots or 0)
                else f"{end} context tokens and a draft tree's nodes to slot {slots}"
            )
            raise ValueError(
                f"stage {self.stage!r}: {what} exceed the request's KV cache of {cache.capacity} positions "
                f"(its prompt and max_new_tokens)"
            )

    def _forward(
        self, work: Sequence[tuple[CacheFeed, tuple[int, int, int]]]
    ) -> tuple[tuple[torch.Tensor, ...], list[tuple[int, int]]]:
        """One packed forward of a piece (start, length, _) of each feed -> (outputs [1, T, ...], each piece's (row, length))."""
        ids: list[int] = []
        positions: list[int] = []  # in the cache
        rotaries: list[int] = []
        pieces, spans = [], []
        device = work[0][0].cache.device
        for feed, (start, length, _) in work:
            fed, slots, rotary = feed.rows(start, length, self.tree_gap)
            tree = None
            if feed.nodes is not None:
                tree = TreeRows.of(len(ids), length, feed.keep + length, self.tree_gap, feed.nodes, device)
            pieces.append(Piece(feed.cache, len(ids), len(fed), tree))
            spans.append((len(ids), len(fed)))
            ids += fed
            positions += slots
            rotaries += rotary
        pad = self.bucket(len(ids)) - len(ids)  # rows of no request (alone on a GPU: its own padding)
        positions += range(positions[-1] + 1, positions[-1] + 1 + pad)
        rotaries += range(rotaries[-1] + 1, rotaries[-1] + 1 + pad)
        ids += ids[-1:] * pad
        ids_t = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
        positions_t = torch.tensor([positions], dtype=torch.long, device=device)  # [1, T]
        rotary = torch.tensor([rotaries], dtype=torch.long, device=device) if rotaries != positions else positions_t
        if self.graphs is not None and len(pieces) == 1 and pieces[0].tree is None:
            with _GRAPHS:  # a replay's outputs: overwritten by the next one, copied now
                return tuple(out.clone() for out in self.graphs(pieces[0].cache, ids_t, torch.cat([positions_t, rotary]))), spans
        with packed(self._packing(pieces, positions_t)):
            return self.step(ids_t, rotary), spans

    def _alone(self, cache: StaticKV, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One request's piece (ids [1, w]; positions [2, w]: in the cache, rotary): what a CUDA graph captures,
        per cache and width."""
        with packed(self._packing([Piece(cache, 0, ids.shape[1])], positions[:1])):
            return self.step(ids, positions[1:])

    def _packing(self, pieces: Sequence[Piece], positions: torch.Tensor) -> Packing:
        return Packing(pieces, positions, self.least, self.invariance.queries)

    def bucket(self, rows: int) -> int:
        """The rows of the forward that carries `rows` packed rows: the least bucket that holds them."""
        for bucket in self.buckets:
            if bucket >= rows:
                return bucket
        return 1 << (rows - 1).bit_length()  # past the widest (more requests than `max_batch`): compiled when first met

    def warm_up(self, caches: KVPool[StaticKV], filler: int) -> None:
        """Run every bucket once on caches of the stage's pool (compiling it, when compiled); the time is logged and kept."""
        began = time.perf_counter()
        widest = self.shapes.widths[-1]
        held = [caches.take(caches.size_for(widest)) for _ in range(max(1, self.buckets[-1] // widest))]
        try:
            for bucket in self.buckets:
                width = min(bucket, widest)
                self([CacheFeed(cache, 0, [filler] * width) for cache in held[: max(1, bucket // widest)]])
        finally:
            for cache in held:
                caches.give(cache)
        self.warmup_s = time.perf_counter() - began
        how = "compiled" if self.compiled else "eager"
        log.info("stage %r: %s forwards at row buckets %s warmed up in %.1f s", self.stage, how, self.buckets, self.warmup_s)


def _own_code(step: PackedStep, stage: str) -> PackedStep:
    """`step` (a stage's bound method) with a code object of its own. Dynamo keeps compiled graphs per code object,
    and a step's guards leave out the stage's modules (`_without_registry_guards`) while its inputs, token ids and
    positions, say nothing of the model: two stages of one kind in a process would otherwise share graphs."""
    function = step.__func__  # type: ignore[attr-defined]
    code = function.__code__.replace(co_name=f"{function.__name__}_{stage}")
    own = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    return own.__get__(step.__self__)  # type: ignore[attr-defined]
