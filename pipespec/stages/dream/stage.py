"""The `dream` stage: the middle of the hierarchy, verifying the tiny drafter and proposing to the VLM target.

It sees the target's prompt (image positions included, as the target's merged input embeddings) and
reads the target's features through `TargetFeatures` messages: at prefill the prompt's embeddings,
hidden states and image attention; after each verification step the hidden states of the positions
the target holds as true. Until the prefill features arrive the runner does not step it.

Memory (`FeatureMemory`): one feature per context position, the target's where it has sent one and
the drafter's own predicted f beyond (feature-level autoregression). When a target feature replaces
an own one that later queries already used, those queries are stale: the next `forward` recomputes
from there (its token ids are known), so the caches always reflect the best memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pipespec.engine.stage import check_keep, check_length
from pipespec.protocol.messages import RequestSpec, TargetFeatures
from pipespec.stages.build_context import ALONE, BuildContext
from pipespec.stages.causal_lm import DTYPES
from pipespec.stages.device import stage_device
from pipespec.stages.dream.checkpoint import DreamCheckpoint, load
from pipespec.stages.dream.compression import kept_positions
from pipespec.stages.vocabulary import LogitsFit

if TYPE_CHECKING:
    from pipespec.config import StageSpec


class FeatureMemory:
    """Features by context position; target entries are authoritative, own ones provisional.

    Held in preallocated tensors indexed by position (doubled when a position falls past them): a
    feature per position, whether one is held there and whether it came from the target. With
    `project` (the cross-attention block's `project`), each entry's keys and values are computed once,
    when it is stored, so a drafting step attends over the memory without re-projecting it. A step
    gathers the held entries in position order with one indexing (before, a Python stack of every
    entry). Its tensors are only changed in inference mode (they may be inference tensors once grown).
    """

    def __init__(
        self, hidden_size: int, device: torch.device, dtype: torch.dtype, project: Projection | None = None, capacity: int = 256
    ):
        self.project = project
        self.features = torch.zeros(capacity, hidden_size, device=device, dtype=dtype)  # [C, H] by position
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None  # [heads, C, d] each, from the first store
        self.held = torch.zeros(capacity, dtype=torch.bool, device=device)  # [C]
        self.targets = torch.zeros(capacity, dtype=torch.bool, device=device)  # [C]: held and the target's
        self._order: torch.Tensor | None = None  # [m] the held positions, ascending; None: changed since

    def _fit(self, end: int) -> None:
        """Room for positions below `end`."""
        size = len(self.held)
        if end <= size:
            return
        size = max(end, 2 * size)
        self.features, self.held, self.targets = (
            _grown(self.features, size),
            _grown(self.held, size),
            _grown(self.targets, size),
        )
        if self.kv is not None:
            self.kv = tuple(_grown(t.transpose(0, 1), size).transpose(0, 1) for t in self.kv)

    @torch.inference_mode()
    def _store(self, positions: Sequence[int], features: torch.Tensor, from_target: bool) -> None:
        """features [n, H] for `positions`, projected in one batch."""
        if not len(positions):
            return
        self._fit(max(positions) + 1)
        at = torch.tensor(list(positions), dtype=torch.long, device=self.held.device)  # [n]
        self.features[at] = features
        if self.project is not None:
            keys, values = self.project(features[None])  # [1, heads, n, d] each
            if self.kv is None:
                shape = (keys.shape[1], len(self.held), keys.shape[3])
                self.kv = tuple(torch.zeros(shape, dtype=keys.dtype, device=keys.device) for _ in range(2))
            self.kv[0][:, at], self.kv[1][:, at] = keys[0], values[0]
        self.held[at] = True
        self.targets[at] = from_target
        self._order = None

    def _own(self, positions: Sequence[int]) -> list[bool]:
        """Whether each of `positions` holds an own (not the target's) entry."""
        size = len(self.held)
        own = (self.held & ~self.targets).tolist()
        return [p < size and own[p] for p in positions]

    def put_target(self, positions: Sequence[int], features: torch.Tensor) -> int | None:
        """Store target features; -> the smallest position where an own entry was replaced, if any."""
        positions = list(positions)
        replaced = [p for p, own in zip(positions, self._own(positions)) if own]
        self._store(positions, features, True)
        return min(replaced) if replaced else None

    def put_own(self, positions: Sequence[int], features: torch.Tensor) -> None:
        targets = self.targets.tolist()
        fresh = [i for i, p in enumerate(positions) if p >= len(targets) or not targets[p]]
        self._store([positions[i] for i in fresh], features[fresh], False)

    @torch.inference_mode()
    def drop_own_from(self, position: int) -> None:
        stale = self.held[position:] & ~self.targets[position:]
        if bool(stale.any()):
            self.held[position:] &= ~stale
            self._order = None

    def from_target(self, position: int) -> bool:
        return position < len(self.targets) and bool(self.targets[position])

    def positions(self) -> torch.Tensor:
        """[m] the positions held, ascending."""
        if self._order is None:
            self._order = self.held.nonzero().squeeze(-1)
        return self._order

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (features [1, m, H], positions [m]) in position order."""
        order = self.positions()
        return self.features[order][None], order

    def projected(self) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """-> ((keys, values [1, heads, m, d]), positions [m]) in position order; None without a projection or entries."""
        order = self.positions()
        if self.kv is None or not len(order):
            return None
        return (self.kv[0][:, order][None], self.kv[1][:, order][None]), order


def _grown(t: torch.Tensor, size: int) -> torch.Tensor:
    """`t` in a buffer `size` long along its first dimension, its entries first, the rest zero."""
    out = t.new_zeros(size, *t.shape[1:])
    out[: len(t)] = t
    return out


Projection = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DreamStage:
    def __init__(self, name: str, ckpt: DreamCheckpoint, width: int | None = None, valid: int | None = None):
        """`width`, `valid`: the pipeline's vocabulary (see pipespec.stages.vocabulary)."""
        self.name = name
        self.drafter = ckpt.drafter
        self.embed = ckpt.embed  # [V, H]
        self.lm_head = ckpt.lm_head  # [V, H]
        self.device = self.embed.device
        self.keep_fraction = ckpt.keep_fraction
        self.fit = LogitsFit.of(name, self.lm_head.shape[0], width, valid)
        self.vocab_size = self.fit.width

    @classmethod
    def from_spec(cls, spec: StageSpec, at: BuildContext = ALONE) -> DreamStage:
        """The checkpoint in `spec.model`, in `spec.dtype` on `spec.device`; its logits fit `at.width` and `at.valid`."""
        return cls(spec.name, load(spec.model, DTYPES[spec.dtype], stage_device(spec.name, spec.device)), at.width, at.valid)

    def open(self, request: RequestSpec) -> DreamSession:
        return DreamSession(self, request.prompt_token_ids, request.max_new_tokens)

    def new_memory(self, capacity: int = 1) -> FeatureMemory:
        """A memory for `capacity` context positions (it grows past them if needed)."""
        project = torch.inference_mode()(self.drafter.block1.project) if self.drafter.config.cross_attention else None
        return FeatureMemory(self.drafter.config.hidden_size, self.device, self.embed.dtype, project, capacity)


class DreamSession:
    def __init__(self, stage: DreamStage, prompt: Sequence[int], max_new_tokens: int):
        self.stage = stage
        self.tokens = list(prompt)  # context ids: the target's prompt, then generated tokens
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]
        self.memory = stage.new_memory(len(prompt) + max_new_tokens)  # preallocated for the whole request
        self.caches = stage.drafter.new_caches(len(prompt) + max_new_tokens)
        self.fed = 0  # context positions the caches cover (kept ones; dropped image positions count too)
        self.stale_from: int | None = None  # an own memory entry here was replaced after later queries used it
        self.prefill_embeddings: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None  # [P - 1] bool: prompt positions kept (compression)

    def add_features(self, features: TargetFeatures) -> None:
        """Compute thread: take the target's features (prefill first, then per verification)."""
        device, dtype = self.stage.device, self.stage.embed.dtype  # features may come from another device
        if features.prefill is not None:
            pre = features.prefill
            image_mask = pre.image_mask.to(device)
            self.kept = kept_positions(image_mask, pre.attention_received, self.stage.keep_fraction)
            self.prefill_embeddings = pre.embeddings.to(device, dtype)
            positions = self.kept.nonzero().squeeze(-1).tolist()
            self.memory.put_target(positions, pre.hidden.to(device, dtype)[self.kept])
            return
        positions = range(features.start, features.start + len(features.hidden))
        replaced = self.memory.put_target(positions, features.hidden.to(device, dtype))
        if replaced is not None and replaced + 1 < self.fed:
            self.stale_from = replaced if self.stale_from is None else min(self.stale_from, replaced)

    @torch.inference_mode()
    def _run(self, positions: list[int], inputs: torch.Tensor) -> torch.Tensor:
        """Feed inputs [n, H] at positions; store our features; -> f [n, H]."""
        projected = self.memory.projected()
        kv = None
        if projected is not None:
            (kv, memory_positions), memory = projected, None
        else:
            memory, memory_positions = self.memory.tensors()
        pos = torch.tensor(positions, dtype=torch.long, device=inputs.device)
        f, _ = self.stage.drafter(inputs[None], pos, memory, memory_positions, self.caches, kv)
        self.memory.put_own(positions, f[0])
        return f[0]

    def _prefill(self) -> None:
        assert self.prefill_embeddings is not None and self.kept is not None, "prefill features must come first"
        positions = self.kept.nonzero().squeeze(-1).tolist()
        self._run(positions, self.prefill_embeddings[self.kept].to(self.stage.embed.dtype))
        self.fed = self.prompt_len - 1

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        name = self.stage.name
        if self.fed == 0 and self.prompt_len > 1 and len(self.kept):
            self._prefill()
        check_keep(name, keep, self.fed)
        start = keep if self.stale_from is None else max(self.prompt_len - 1, min(keep, self.stale_from + 1))
        assert start >= self.prompt_len - 1, (start, self.prompt_len)
        self.stale_from = None
        self.caches.keep_before(start)
        self.memory.drop_own_from(keep)  # tokens before `keep` are unchanged: their own features still hold
        self.tokens[keep:] = list(tokens)
        positions = list(range(start, keep + len(tokens)))
        ids = torch.tensor(self.tokens[start : keep + len(tokens)], dtype=torch.long, device=self.stage.device)
        f = self._run(positions, self.stage.embed[ids])
        self.fed = keep + len(tokens)
        check_length(name, int(self.caches.block0.positions[-1]) + 1, self.fed)
        with torch.inference_mode():
            logits = f[-len(tokens) :] @ self.stage.lm_head.T  # [n, V]
        return self.stage.fit(logits.float())

    def close(self) -> None:
        self.memory = self.stage.new_memory()
        self.caches = self.stage.drafter.new_caches(1)
