"""Several requests' tokens as one forward of a Hugging Face model: packed rows, attention per request.

A batched forward of many requests (pipespec.engine.stage.BatchingStage) packs their pieces of tokens
along one sequence, `[1, T]`, each piece at its own positions (`position_ids`), so every matrix product
of the model runs once over all T rows. Attention is the one part that must not mix requests: the model's
text layers run the attention registered here ("pipespec_packed"), a custom op that dynamo does not trace
into, so a compiled forward's graph depends on T alone, not on how many requests it carries or where
each one stands. The op reads what the forward packed (`Packing`, set around the forward by `packed`),
and for each piece writes its keys and values into the request's `StaticKV` at its positions and attends
over that whole cache, the keys past each row's position masked (and those a sliding window drops),
exactly the call it makes when the request is alone. Rows that pad T past the pieces belong to no
request: their attention output is zero.

What keeps a request's logits bitwise the same whatever shares its forward (issue 56, measured by
dev/batch_invariance.py on this CPU): a product's row depends on the row count only below 4 rows
(fp32; bf16 never), and a target's forwards have at least 4 rows; every other operation of a layer is
per row; and attention is this per-request call, of the same shapes alone or packed: a piece shorter
than `Packing.least` attends with its last query row repeated up to it, as a query row's result depends
on the query count only below 4 (pipespec.stages.forwards).

A piece may end in a draft tree's nodes (`TreeRows`, pipespec.engine.stage.TreeNodes): each node attends to its own
path only, as that path's one-token decode would, so a node's logits are bitwise that decode's.

A prompt goes in by chunks, pieces of an eager forward of input embeddings (pipespec.stages.packed_forwards.
PackedForwards.prefill). A model that makes its own prefill's positions or mask (Qwen2-VL's multimodal rotary
positions, Gemma 3's image tokens that attend to their whole image) prefills whole instead, one piece at
position 0 (`prefill`), which attends with the mask transformers builds for it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pipespec.engine.stage import TreeNodes
from pipespec.stages.static_kv import StaticKV

IMPLEMENTATION = "pipespec_packed"
PREFILL = "pipespec_prefill"  # the same attention, given the mask transformers builds for the model (`prefill`)


@dataclass(frozen=True)
class NodeGroup:
    """The rows of a piece's draft-tree nodes that lie on one path from the tree's root (its own rows: those no
    earlier group answers), with the cache slots of the path's nodes."""

    rows: torch.Tensor  # [m] long: the forward's rows it answers, by depth
    positions: torch.Tensor  # [m] long: their positions on the path
    path: torch.Tensor  # [d] long: the cache slots of the path's nodes, the root's child first


@dataclass(frozen=True)
class TreeRows:
    """A piece that feeds a line, then draft-tree nodes (pipespec.engine.stage.TreeNodes) after `base` cache entries:
    node i's keys kept at slot `base + gap + i` (`gap`: room for a path, its forward's widest), its position the
    one after its parent's. Its nodes' rows attend by groups, one per path from the tree's root to a leaf of the
    nodes fed: the path's entries copied to the slots after the root, the group attends over the cache as the
    path's one-token decodes do (bitwise: the same keys at the same slots, those past a row's position masked)."""

    line: int  # the piece's first rows: its line, attended as any piece's rows
    base: int
    groups: tuple[NodeGroup, ...]

    @classmethod
    def of(cls, offset: int, line: int, base: int, gap: int, nodes: TreeNodes, device: torch.device) -> TreeRows:
        """The rows of a piece at row `offset` of its forward that feeds `line` tokens, then `nodes.fed`."""
        tree, fed = nodes.tree, set(nodes.fed)
        row = {node: offset + line + k for k, node in enumerate(nodes.fed)}
        groups, answered = [], set()
        for leaf in (n for n in nodes.fed if not fed.intersection(tree.children(n))):
            path = tree.path(leaf)
            mine = [n for n in path if n in fed and n not in answered]
            answered.update(mine)
            groups.append(
                NodeGroup(
                    torch.tensor([row[n] for n in mine], device=device),
                    torch.tensor([base + tree.depths[n] - 1 for n in mine], device=device),
                    torch.tensor([base + gap + n for n in path], device=device),
                )
            )
        return cls(line, base, tuple(groups))


@dataclass(frozen=True)
class Piece:
    """One request's rows of a packed forward: `width` rows from row `offset` (their positions: the packing's),
    draft-tree nodes among them (`tree`) or not."""

    cache: StaticKV
    offset: int
    width: int
    tree: TreeRows | None = None

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.width)


@dataclass
class Packing:
    """What one packed forward carries: its pieces, in row order, every row's position, and the pieces' masks,
    built once per forward from the positions tensor (a CUDA graph captured over it serves any positions)."""

    pieces: Sequence[Piece]
    positions: torch.Tensor  # [1, T] long: each row's position in its request's context
    least: int = 1  # a piece's attention runs over at least this many query rows (its last one repeated)
    step: int = 1  # ... and over a multiple of this many (pipespec.stages.invariance)
    _masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def query_rows(self, n: int) -> int:
        """The query rows a piece of `n` rows attends with."""
        return max(self.least, self.step * -(-n // self.step))

    def mask(self, i: int, window: int, queries: int) -> torch.Tensor:
        """[1, 1, q, capacity] bool: which of its cache's keys each of piece i's `queries` rows sees (True: attend);
        the rows past its own repeat its last."""
        mask = self._masks.get((i, window))
        if mask is None:
            piece = self.pieces[i]
            mask = self._masks[(i, window)] = causal(self.positions[0, piece.rows], piece.cache.capacity, window, queries)
        return mask


def causal(positions: torch.Tensor, capacity: int, window: int, queries: int) -> torch.Tensor:
    """positions [m] of query rows -> [1, 1, q, capacity] bool: the keys each sees (its own position and before, within
    `window` if set); the rows past m repeat the last."""
    rows = _at_least(positions, queries, 0)[:, None]  # [q, 1]
    keys = torch.arange(capacity, device=rows.device)[None, :]  # [1, C]
    mask = keys <= rows
    if window:
        mask &= keys > rows - window
    return mask[None, None]


_current = threading.local()  # a stage's forwards run on its compute thread; two stages may share a process


@contextmanager
def packed(packing: Packing) -> Iterator[None]:
    """The forwards inside (on this thread) carry `packing`'s pieces."""
    before, _current.packing = getattr(_current, "packing", None), packing
    try:
        yield
    finally:
        _current.packing = before


def _packing() -> Packing:
    packing = getattr(_current, "packing", None)
    if packing is None:
        raise RuntimeError("a packed attention ran outside `packed(...)`: the model's forward was not given its pieces")
    return packing


@torch.library.custom_op("pipespec::packed_attention", mutates_args=())
def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float,
    window: int,
    given: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [1, heads, T, d], key and value [1, kv_heads, T, d] of the packed rows -> [1, T, heads, d]: each
    piece's attention over its own cache, its keys and values written there first. `given` [.., T, T] bool: a
    prefill's own mask, transformers' (see `prefill`), in place of the causal one built from positions."""
    packing = _packing()
    groups = query.shape[1] // key.shape[1]
    alone = (
        len(packing.pieces) == 1 and packing.pieces[0].offset == 0 and packing.pieces[0].tree is None
    )  # its attention is the output
    out = None if alone else query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [1, T, heads, d]
    for i, piece in enumerate(packing.pieces):
        rows, at = piece.rows, packing.positions[0, piece.rows]  # [w]
        held = piece.cache.layers[layer]
        held.keys.index_copy_(2, at, key[:, :, rows])
        held.values.index_copy_(2, at, value[:, :, rows])
        if piece.tree is not None:
            _tree_attention(query, held, groups, piece, packing, scaling, window, out)
            continue
        keys, values = repeat_kv(held.keys, groups), repeat_kv(held.values, groups)  # [1, heads, C, d]
        # alone, its query rows reach every row of the forward: the rows past its own are no request's (any output);
        # a prefill with its own mask attends with exactly its rows
        n = query.shape[2] if alone else piece.width
        queries = _at_least(query[:, :, rows], n if given is not None else packing.query_rows(n), 2)
        mask = packing.mask(i, window, queries.shape[2]) if given is None else _over_cache(given, held.keys.shape[2])
        attended = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling)
        if alone:
            return attended[:, :, :n].transpose(1, 2).contiguous()
        out[:, rows] = attended[:, :, : piece.width].transpose(1, 2)
    return out


def _tree_attention(
    query: torch.Tensor, held: Any, groups: int, piece: Piece, packing: Packing, scaling: float, window: int, out: torch.Tensor
) -> None:
    """A tree piece's attention into `out` [1, T, heads, d]: its line's rows as any piece's, then each group of its
    nodes' rows with its path's entries put after the root (`TreeRows`), in place: past the request's length, where
    only rows past it see them."""
    tree, capacity = piece.tree, held.keys.shape[2]

    def attend(rows: torch.Tensor | slice, positions: torch.Tensor, n: int) -> None:
        queries = _at_least(query[:, :, rows], packing.query_rows(n), 2)
        mask = causal(positions, capacity, window, queries.shape[2])
        keys, values = repeat_kv(held.keys, groups), repeat_kv(held.values, groups)  # [1, heads, C, d]
        attended = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling)
        out[:, rows] = attended[:, :, :n].transpose(1, 2)

    if tree.line:
        rows = slice(piece.offset, piece.offset + tree.line)
        attend(rows, packing.positions[0, rows], tree.line)
    for group in tree.groups:
        chain = torch.arange(tree.base, tree.base + len(group.path), device=query.device)
        held.keys.index_copy_(2, chain, held.keys.index_select(2, group.path))
        held.values.index_copy_(2, chain, held.values.index_select(2, group.path))
        attend(group.rows, group.positions, len(group.rows))


def _at_least(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """`t` with its last entry along `dim` repeated until it has at least `rows` there."""
    short = rows - t.shape[dim]
    if short <= 0:
        return t
    return torch.cat([t, t.narrow(dim, t.shape[dim] - 1, 1).expand(*t.shape[:dim], short, *t.shape[dim + 1 :])], dim)


@packed_attention.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float,
    window: int,
    given: torch.Tensor | None = None,
) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def _over_cache(given: torch.Tensor, capacity: int) -> torch.Tensor:
    """A prefill's own mask [.., T, T] bool (its keys at positions 0 .. T - 1) -> [1, 1, T, capacity] over its cache."""
    if given.dtype != torch.bool:
        raise ValueError(f"a prefill's attention mask must be boolean, got {given.dtype}")
    rows = given.shape[-2]
    mask = torch.zeros(1, 1, rows, capacity, dtype=torch.bool, device=given.device)
    mask[..., : given.shape[-1]] = given[:1, :1] if given.dim() == 4 else given
    return mask


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, d]
    key: torch.Tensor,  # [1, kv_heads, T, d]: the packed rows' own
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # None: an implementation transformers has no mask for
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The text layers' attention (transformers' AttentionInterface) -> ([1, T, heads, d], where the module keeps
    them (an eager prefill), each piece's attention weights [1, heads, w, C])."""
    if kwargs.get("softcap") is not None:
        raise ValueError("packed attention does not support attention logit softcapping")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    window = int(sliding_window or 0)
    given = attention_mask if module.config._attn_implementation == PREFILL else None  # a decode's is no request's
    out = packed_attention(query, key, value, module.layer_idx, scale, window, given)
    if not getattr(module, "keep_weights", False):
        return out, None
    return out, _weights(query, scale, window, module.layer_idx, given)


def _weights(query: torch.Tensor, scale: float, window: int, layer: int, given: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Each piece's attention weights [1, heads, w, C] over its own cache (what sdpa never materialises)."""
    packing = _packing()
    out = []
    for i, piece in enumerate(packing.pieces):
        held = piece.cache.layers[layer]
        keys = repeat_kv(held.keys, query.shape[1] // held.keys.shape[1]).float()
        scores = (query[:, :, piece.rows].float() @ keys.transpose(-1, -2)) * scale  # [1, heads, w, C]
        mask = packing.mask(i, window, piece.width)[..., : piece.width, :] if given is None else _over_cache(given, keys.shape[2])
        out.append(scores.masked_fill(~mask, float("-inf")).softmax(-1))
    return tuple(out)


AttentionInterface.register(IMPLEMENTATION, attention)
AttentionInterface.register(PREFILL, attention)
AttentionMaskInterface.register(PREFILL, sdpa_mask)  # transformers builds a prefill's mask: Gemma 3's image blocks


def use_packed_attention(model: PreTrainedModel) -> threading.RLock:
    """Make `model`'s text layers attend with `attention` (a vision tower keeps its own); -> the model's lock,
    which every forward of it holds: a prefill (or a lent `generate`) switches the attention its config names,
    and a model may serve stages of two pipelines at once (tests share loaded stages)."""
    model.config.get_text_config(decoder=True)._attn_implementation = IMPLEMENTATION
    with _LOCKS:
        if not hasattr(model, "pipespec_lock"):
            model.pipespec_lock = threading.RLock()
    return model.pipespec_lock


_LOCKS = threading.Lock()


@contextmanager
def prefill(model: PreTrainedModel, cache: StaticKV, length: int) -> Iterator[None]:
    """The model's forward inside feeds one request's first `length` context tokens (its prompt but the last)
    into `cache`, from position 0: one piece, eager, attending with the mask transformers builds for the model
    (causal, and whatever the model adds: Gemma 3's image tokens see their whole image); the cache then holds
    `length` positions."""
    text = model.config.get_text_config(decoder=True)
    positions = torch.arange(length, device=cache.device)[None]  # [1, P - 1]
    with model.pipespec_lock:
        text._attn_implementation = PREFILL
        try:
            with packed(Packing([Piece(cache, 0, length)], positions)):
                yield
        finally:
            text._attn_implementation = IMPLEMENTATION
    cache.rewind(length)


@contextmanager
def plain_attention(model: PreTrainedModel) -> Iterator[None]:
    """`model`'s text layers on transformers' own sdpa attention meanwhile: a stage's model lent to Hugging Face's
    `generate` (a benchmark's reference), which feeds it through transformers' caches, not `packed`."""
    text = model.config.get_text_config(decoder=True)
    with model.pipespec_lock:
        text._attn_implementation = "sdpa"
        try:
            yield
        finally:
            text._attn_implementation = IMPLEMENTATION
