"""The DREAM drafter network (design section 4): three blocks at the target's hidden size.

    x_t  = E[token_t]   (the target's frozen embedding table; for image positions, the target's
                         merged input embedding there)
    a_t  = block0(x)_t                   self-attention over token embeddings only (no input norm)
    c_t  = a_t + tanh(g) CrossAttn(a_t, memory entries at positions <= t - 1)   (gated, q/k norm, no RoPE;
                                           a learned per-head recency bias from the explicit positions)
    f_t  = norm(block2(c)_t)             standard self-attention + MLP
    logits_t = lm_head(f_t)              (the target's frozen head) predict token t + 1

Memory entry j is a feature of position j: the target's last-layer post-norm hidden state where the
target has verified, the drafter's own f_j beyond (feature-level autoregression). Every query, key
and memory entry carries its explicit original position, and every mask is built from positions,
never from offsets, so dropped image tokens (compression) and rollbacks stay correct.

`cross_attention=False` is the EAGLE-style ablation the DREAM paper compares against: a single block
fed fc([E[token_t] ; feature_{t-1}]) (EAGLE's fusion of the token with the previous feature), then the
final norm and head; no cross-attention, no intermediate block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DreamConfig:
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    cross_attention: bool = True  # False: the EAGLE-style ablation (one block fed the previous feature)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)


class BlockCache:
    """One self-attention block's keys and values, with the positions they belong to, at a fixed capacity.

    Entries lie densely in the order they were fed (positions ascend; dropped image positions leave no
    gap), the first `length` of them in use. `length` is a tensor, so a compiled step never specialises
    on it: attention reads the whole buffer, the entries in use marked (`in_use`), and every step sees
    the same shapes whatever the request's length. `extend` writes after the entries in use and counts
    them in; `keep_before` rolls back by counting again. Nothing is copied or reallocated per step."""

    def __init__(self, config: DreamConfig, dtype: torch.dtype, device: torch.device, capacity: int):
        self.length = torch.zeros((), dtype=torch.long, device=device)  # entries in use
        self.index = torch.arange(capacity, device=device)  # [C]
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)  # [C]: ascending over those in use
        self.keys = torch.zeros(config.num_heads, capacity, config.head_dim, dtype=dtype, device=device)  # [heads, C, d]
        self.values = torch.zeros_like(self.keys)

    def in_use(self) -> torch.Tensor:
        """[C] bool: the entries in use."""
        return self.index < self.length

    def end(self) -> int:
        """One past the last position in use (0 when none)."""
        n = int(self.length)
        return int(self.positions[n - 1]) + 1 if n else 0

    def keep_before(self, position: int) -> None:
        """Keep the entries of positions before `position`."""
        self.length.copy_(((self.positions < position) & self.in_use()).sum())

    def extend(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """positions [n], keys and values [heads, n, d], after the entries in use (the caller keeps within capacity)."""
        at = self.length + torch.arange(len(positions), device=positions.device)  # [n]
        self.positions.index_copy_(0, at, positions)
        self.keys.index_copy_(1, at, keys)
        self.values.index_copy_(1, at, values)
        self.length.add_(len(positions))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [heads, n, d] at explicit positions [n]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.float()[:, None] * inv[None]  # [n, d/2]
    cos, sin = angles.cos().repeat(1, 2).to(x.dtype), angles.sin().repeat(1, 2).to(x.dtype)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


class MLP(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SelfBlock(nn.Module):
    """Pre-norm self-attention (RoPE at explicit positions, causal by position) + MLP."""

    def __init__(self, config: DreamConfig, input_norm: bool = True):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.input_norm = nn.RMSNorm(h, eps=config.rms_norm_eps) if input_norm else nn.Identity()
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.post_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: BlockCache | None) -> torch.Tensor:
        """x [B, n, H] at positions [n] (B = 1 with a cache); keys are the cache's and these."""
        q, k, v = self._qkv(x, positions)
        return self._finish(x, self._attend(q, k, v, positions, cache))

    def forward_packed(self, x: torch.Tensor, positions: torch.Tensor, spans: Sequence[tuple[slice, BlockCache]]) -> torch.Tensor:
        """x [1, T, H] at positions [T]: several requests' rows, each span of them over its own cache."""
        q, k, v = self._qkv(x, positions)
        out = [self._attend(q[:, :, rows], k[:, :, rows], v[:, :, rows], positions[rows], cache) for rows, cache in spans]
        return self._finish(x, torch.cat(out, dim=2))

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q, k, v [B, heads, n, d], rotated to their positions."""
        c = self.config
        B, n, _ = x.shape
        q, k, v = self.qkv(self.input_norm(x)).view(B, n, 3, c.num_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cache: BlockCache | None
    ) -> torch.Tensor:
        """One request's (or a training batch's) attention -> [B, heads, n, d]."""
        mask = positions[None, :] <= positions[:, None]  # [n, n]: a query sees itself and earlier positions
        if cache is not None:  # and the cached ones before it
            cache.extend(positions, k[0], v[0])
            k, v = cache.keys[None], cache.values[None]
            mask = cache.in_use()[None, :] & (cache.positions[None, :] <= positions[:, None])  # [n, C]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, n, _ = x.shape
        x = x + self.o(out.transpose(1, 2).reshape(B, n, -1))
        return x + self.mlp(self.post_norm(x))


class CrossBlock(nn.Module):
    """Gated cross-attention over the feature memory (Mllama style: per-head q/k RMSNorm, no RoPE)."""

    def __init__(self, config: DreamConfig):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.input_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.memory_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.q = nn.Linear(h, h, bias=False)
        self.kv = nn.Linear(h, 2 * h, bias=False)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.o = nn.Linear(h, h, bias=False)
        # ALiBi-style recency: head h scores entry j at -softplus(recency_h) * (t - 1 - pos_j); built from
        # the explicit positions (no RoPE), it lets some heads find the latest features while others
        # read the image by content alone (softplus -> 0). Initial slopes 1/4, 1/16, ... as in ALiBi.
        slopes = torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(config.num_heads)])
        self.recency = nn.Parameter(torch.log(torch.expm1(slopes)))
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.post_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = MLP(config)
        self.mlp_gate = nn.Parameter(torch.zeros(1))

    def project(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """memory [B, m, H] -> keys, values [B, heads, m, d]: a function of each entry alone, so
        inference computes it once per entry (pipespec.stages.dream.stage.FeatureMemory) instead of per step."""
        c = self.config
        B, m, _ = memory.shape
        k, v = self.kv(self.memory_norm(memory)).view(B, m, 2, c.num_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        return self.k_norm(k), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        memory: torch.Tensor | None,
        memory_positions: torch.Tensor,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        memory_held: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, n, H] at positions [n]; memory [B, m, H] at memory_positions [m], or its `project`ion;
        memory_held [m] bool: the entries that hold a feature (None: all)."""
        if len(memory_positions) == 0:  # nothing to attend to yet (a one-token prompt)
            return x
        q = self._query(x)
        kv = memory_kv if memory_kv is not None else self.project(memory)
        return self._finish(x, self._attend(q, positions, kv, memory_positions, memory_held))

    def forward_packed(self, x: torch.Tensor, positions: torch.Tensor, spans: Sequence[tuple[slice, Memory]]) -> torch.Tensor:
        """x [1, T, H] at positions [T]: several requests' rows, each span of them over its own memory's projection."""
        q = self._query(x)
        out = [self._attend(q[:, :, rows], positions[rows], m.kv, m.positions, m.held) for rows, m in spans]
        return self._finish(x, torch.cat(out, dim=2))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, n, H] -> q [B, heads, n, d]."""
        c = self.config
        B, n, _ = x.shape
        return self.q_norm(self.q(self.input_norm(x)).view(B, n, c.num_heads, c.head_dim)).transpose(1, 2)

    def _attend(
        self,
        q: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        memory_positions: torch.Tensor,
        memory_held: torch.Tensor | None,
    ) -> torch.Tensor:
        """One request's (or a training batch's) attention over its memory -> [B, heads, n, d]."""
        k, v = kv
        distance = (positions[:, None] - 1 - memory_positions[None, :]).to(q.dtype)  # [n, m]
        mask = distance >= 0  # entries strictly before the query
        if memory_held is not None:
            mask = mask & memory_held[None, :]
        seen = mask.any(-1)  # [n]: a query with no visible entry gets no attention output
        bias = -F.softplus(self.recency).to(q.dtype)[:, None, None] * distance.clamp(min=0)  # [heads, n, m]
        bias = bias.masked_fill(~(mask | ~seen[:, None]), float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return out * seen[None, None, :, None]

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, n, _ = x.shape
        x = x + torch.tanh(self.attn_gate) * self.o(out.transpose(1, 2).reshape(B, n, -1))
        return x + torch.tanh(self.mlp_gate) * self.mlp(self.post_norm(x))


@dataclass(frozen=True)
class Memory:
    """One request's feature memory as a packed forward reads it: its projection, positions and held entries."""

    kv: tuple[torch.Tensor, torch.Tensor]  # [1, heads, m, d] each
    positions: torch.Tensor  # [m]
    held: torch.Tensor  # [m] bool


class PreviousFeatureFuse(nn.Module):
    """The EAGLE-style ablation's input: fc([x_t ; feature at t - 1]) -> H, instead of cross-attention."""

    def __init__(self, config: DreamConfig):
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        memory: torch.Tensor,
        memory_positions: torch.Tensor,
        memory_held: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # the latest entry strictly before each query (zeros when none)
        visible = memory_positions[None, :] <= positions[:, None] - 1  # [n, m]
        if memory_held is not None:
            visible = visible & memory_held[None, :]
        index = torch.where(visible, memory_positions[None, :], -1).argmax(-1)  # [n]
        previous = memory[:, index] * visible.any(-1)[None, :, None]  # [B, n, H]
        return self.fc(torch.cat([x, self.norm(previous)], dim=-1))


@dataclass
class DraftCaches:
    block0: BlockCache
    block2: BlockCache

    def keep_before(self, position: int) -> None:
        self.block0.keep_before(position)
        self.block2.keep_before(position)

    def end(self) -> int:
        """One past the last position cached (0 when none)."""
        return self.block0.end()


class DreamDrafter(nn.Module):
    """The trainable blocks; the target's embedding table and LM head are passed in, frozen."""

    def __init__(self, config: DreamConfig):
        super().__init__()
        self.config = config
        if config.cross_attention:
            self.block0 = SelfBlock(config, input_norm=False)
            self.block1 = CrossBlock(config)
            self.block2 = SelfBlock(config)
        else:  # the EAGLE-style ablation: one block, its cache in `block0`'s place
            self.fuse = PreviousFeatureFuse(config)
            self.block0 = SelfBlock(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def new_caches(self, capacity: int) -> DraftCaches:
        """Caches for `capacity` context positions."""
        p = next(self.parameters())
        return DraftCaches(*(BlockCache(self.config, p.dtype, p.device, capacity) for _ in range(2)))

    def forward(
        self,
        inputs: torch.Tensor,  # [B, n, H] input embeddings
        positions: torch.Tensor,  # [n] their positions
        memory: torch.Tensor | None,  # [B, m, H] features (None when `memory_kv` is given)
        memory_positions: torch.Tensor,  # [m]
        caches: DraftCaches | None = None,  # inference (B = 1): earlier positions' keys and values
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # the memory's projection, if already known
        memory_held: torch.Tensor | None = None,  # [m] bool: the memory entries that hold a feature (None: all)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (f [B, n, H] predicted features, block 0's output [B, n, H] for the intermediate
        supervision, or None for the EAGLE-style ablation, which has no intermediate block)."""
        if not self.config.cross_attention:
            x = self.fuse(inputs, positions, memory, memory_positions, memory_held)
            return self.norm(self.block0(x, positions, caches.block0 if caches else None)), None
        a = self.block0(inputs, positions, caches.block0 if caches else None)
        c = self.block1(a, positions, memory, memory_positions, memory_kv, memory_held)
        f = self.norm(self.block2(c, positions, caches.block2 if caches else None))
        return f, a

    def forward_packed(
        self,
        inputs: torch.Tensor,  # [1, T, H]: several requests' input embeddings, packed
        positions: torch.Tensor,  # [T] their positions
        requests: Sequence[tuple[slice, DraftCaches, Memory]],  # each request's rows, caches and memory, in row order
    ) -> torch.Tensor:
        """Inference over several requests at once (cross-attention drafters): the products over every row, each
        request's attention over its own caches and memory. -> f [1, T, H]."""
        a = self.block0.forward_packed(inputs, positions, [(rows, caches.block0) for rows, caches, _ in requests])
        c = self.block1.forward_packed(a, positions, [(rows, memory) for rows, _, memory in requests])
        return self.norm(self.block2.forward_packed(c, positions, [(rows, caches.block2) for rows, caches, _ in requests]))
