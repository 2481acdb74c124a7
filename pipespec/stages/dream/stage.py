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
from dataclasses import dataclass
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

    With `project` (the cross-attention block's `project`), each entry's keys and values are computed
    once, when it is stored, so a drafting step attends over the memory without re-projecting it.
    """

    def __init__(self, hidden_size: int, device: torch.device, dtype: torch.dtype, project: Projection | None = None):
        self.empty = torch.empty(1, 0, hidden_size, device=device, dtype=dtype), torch.empty(0, dtype=torch.long, device=device)
        self.project = project
        self.entries: dict[int, _Entry] = {}
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stacked_kv: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def _store(self, positions: Sequence[int], features: torch.Tensor, from_target: bool) -> None:
        """features [n, H] for `positions`, projected in one batch."""
        if not len(positions):
            return
        kv = self.project(features[None]) if self.project is not None else None  # [1, heads, n, d] each
        for i, (p, f) in enumerate(zip(positions, features)):
            self.entries[p] = _Entry(f, from_target, None if kv is None else (kv[0][0, :, i], kv[1][0, :, i]))
        self._stacked = self._stacked_kv = None

    def put_target(self, positions: Sequence[int], features: torch.Tensor) -> int | None:
        """Store target features; -> the smallest position where an own entry was replaced, if any."""
        replaced = [p for p in positions if p in self.entries and not self.entries[p].from_target]
        self._store(list(positions), features, True)
        return min(replaced) if replaced else None

    def put_own(self, positions: Sequence[int], features: torch.Tensor) -> None:
        fresh = [i for i, p in enumerate(positions) if p not in self.entries or not self.entries[p].from_target]
        self._store([positions[i] for i in fresh], features[fresh], False)

    def drop_own_from(self, position: int) -> None:
        stale = [p for p, e in self.entries.items() if p >= position and not e.from_target]
        for p in stale:
            del self.entries[p]
        if stale:
            self._stacked = self._stacked_kv = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (features [1, m, H], positions [m]) in position order."""
        if not self.entries:
            return self.empty
        if self._stacked is None:
            order = sorted(self.entries)
            feats = torch.stack([self.entries[p].feature for p in order])[None]
            self._stacked = (feats, torch.tensor(order, dtype=torch.long, device=feats.device))
        return self._stacked

    def projected(self) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """-> ((keys, values [1, heads, m, d]), positions [m]) in position order; None without a projection or entries."""
        if self.project is None or not self.entries:
            return None
        if self._stacked_kv is None:
            order = sorted(self.entries)
            kv = tuple(torch.stack([self.entries[p].kv[j] for p in order], dim=1)[None] for j in (0, 1))
            self._stacked_kv = kv, torch.tensor(order, dtype=torch.long, device=kv[0].device)
        return self._stacked_kv


@dataclass(frozen=True)
class _Entry:
    feature: torch.Tensor  # [H]
    from_target: bool
    kv: tuple[torch.Tensor, torch.Tensor] | None  # [heads, d] each: the cross-attention's key and value


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
        return DreamSession(self, request.prompt_token_ids)

    def new_memory(self) -> FeatureMemory:
        project = torch.inference_mode()(self.drafter.block1.project) if self.drafter.config.cross_attention else None
        return FeatureMemory(self.drafter.config.hidden_size, self.device, self.embed.dtype, project)


class DreamSession:
    def __init__(self, stage: DreamStage, prompt: Sequence[int]):
        self.stage = stage
        self.tokens = list(prompt)  # context ids: the target's prompt, then generated tokens
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]
        self.memory = stage.new_memory()
        self.caches = stage.drafter.new_caches()
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
        self.caches = self.stage.drafter.new_caches()
