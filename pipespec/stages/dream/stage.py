"""The `dream` stage: the middle of the hierarchy, verifying the tiny drafter and proposing to the VLM target.

It sees the target's prompt (image positions included, as the target's merged input embeddings) and
reads the target's features through `TargetFeatures` messages: at prefill the prompt's embeddings,
hidden states and image attention; after each verification step the hidden states of the positions
the target holds as true. Until the prefill features arrive the runner does not step it.

Memory (`FeatureMemory`): one feature per context position, the target's where it has sent one and
the drafter's own predicted f beyond (feature-level autoregression). When a target feature replaces
an own one that later positions already read, their cached keys are stale: with `refresh`
(pipespec.schema.kinds.DreamOptions) the next `forward` feeds them again (their token ids are known);
by default they stay, and only positions fed later read the target's feature.

Forwards (pipespec.stages.forwards): each request's caches and memory are preallocated at the stage's
capacity (`DraftState`) and every step reads all of it, entries not in use masked, so a step's shapes
depend only on its width: a step of one request runs compiled at the widths 1 to `max_width` (a stage
kind's `options`); several requests' steps run as one eager forward (`forward_batch`, packed: a
drafter's logits pick drafts, never the answer); the prompt's prefill runs eager at its own length. The checkpoint's
context (its target's) bounds a request's positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pipespec.engine.stage import NO_SIDES, Feed, check_keep, check_length
from pipespec.protocol.messages import RequestSpec, TargetFeatures
from pipespec.schema.kinds import DreamOptions
from pipespec.stages.build_context import ALONE, BuildContext
from pipespec.stages.causal_lm import DTYPES
from pipespec.stages.device import kv_budget, stage_device
from pipespec.stages.dream.checkpoint import DreamCheckpoint, load
from pipespec.stages.dream.compression import kept_positions
from pipespec.stages.dream.model import DraftCaches, DreamConfig, Memory
from pipespec.stages.forwards import Forwards, Shapes, compiles
from pipespec.stages.kv_pool import KVPool
from pipespec.stages.vocabulary import LogitsFit
from pipespec.stages.weight_layout import column_major, column_major_weight

if TYPE_CHECKING:
    from pipespec.config import StageSpec


class FeatureMemory:
    """Features by context position, at a fixed capacity; target entries are authoritative, own ones provisional.

    Preallocated tensors indexed by position: a feature per position, whether one is held there and
    whether it came from the target. With `project` (the cross-attention block's `project`), each
    entry's keys and values are computed once, when it is stored, so a drafting step attends over the
    memory without re-projecting it. A step reads every position, the held ones marked (`held`), so its
    shapes never change with the request (what lets the stage's forwards be compiled).
    """

    def __init__(self, config: DreamConfig, capacity: int, device: torch.device, dtype: torch.dtype, project: Projection | None):
        self.capacity = capacity
        self.project = project
        self.features = torch.zeros(capacity, config.hidden_size, device=device, dtype=dtype)  # [C, H] by position
        self.positions = torch.arange(capacity, device=device)  # [C]
        shape = (config.num_heads, capacity, config.head_dim)
        self.kv = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(2)) if project else None  # [heads, C, d]
        self.held = torch.zeros(capacity, dtype=torch.bool, device=device)  # [C]
        self.targets = torch.zeros(capacity, dtype=torch.bool, device=device)  # [C]: held and the target's

    def clear(self) -> None:
        self.held.zero_()
        self.targets.zero_()

    def _at(self, positions: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """positions as a long tensor [n] on the memory's device; a ValueError past the capacity."""
        at = torch.as_tensor(positions, dtype=torch.long, device=self.held.device).reshape(-1)
        if len(at) and int(at.max()) >= self.capacity:
            raise ValueError(f"a feature at position {int(at.max())} is past the dream stage's {self.capacity} positions")
        return at

    @torch.inference_mode()
    def put_target(self, positions: Sequence[int], features: torch.Tensor) -> int | None:
        """Store target features [n, H] (projected in one batch); -> the smallest position where an own entry was replaced, if any."""
        at = self._at(positions)
        if not len(at):
            return None
        replaced = at[self.held[at] & ~self.targets[at]]
        self.features[at] = features
        if self.project is not None and self.kv is not None:
            keys, values = self.project(features[None])  # [1, heads, n, d] each
            self.kv[0][:, at], self.kv[1][:, at] = keys[0], values[0]
        self.held[at] = True
        self.targets[at] = True
        return int(replaced.min()) if len(replaced) else None

    def put_own(self, at: torch.Tensor, features: torch.Tensor) -> None:
        """Store own features [n, H] at positions at [n] (within the capacity) where the target has not sent
        its own. Tensor operations only, no check that reads a value back: a compiled step runs it."""
        own = ~self.targets[at]  # [n]
        self.features[at] = torch.where(own[:, None], features, self.features[at])
        if self.project is not None and self.kv is not None:
            keys, values = self.project(features[None])  # [1, heads, n, d] each
            for stored, new in zip(self.kv, (keys[0], values[0])):
                stored[:, at] = torch.where(own[None, :, None], new, stored[:, at])
        self.held[at] = True  # the target's entry or now an own one

    @torch.inference_mode()
    def drop_own_from(self, position: int) -> None:
        self.held[position:] &= self.targets[position:]

    def from_target(self, position: int) -> bool:
        return position < self.capacity and bool(self.targets[position])

    def held_positions(self) -> list[int]:
        """The positions held, ascending."""
        return self.held.nonzero().squeeze(-1).tolist()


Projection = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DraftState:
    """One request's drafting state at the stage's capacity: its blocks' caches and its feature memory.

    What the stage's forwards feed (pipespec.stages.forwards): `length` is one past the last position
    cached, `rewind` keeps the cached positions before a point. The memory is the session's to change.
    A closed request's state serves the next one (pipespec.stages.kv_pool)."""

    def __init__(self, caches: DraftCaches, memory: FeatureMemory):
        self.caches = caches
        self.memory = memory

    @property
    def length(self) -> int:
        return self.caches.end()

    @property
    def nbytes(self) -> int:
        """The bytes of its tensors: its blocks' caches and its memory."""
        tensors = [t for c in (self.caches.block0, self.caches.block2) for t in vars(c).values() if isinstance(t, torch.Tensor)]
        tensors += [t for t in vars(self.memory).values() if isinstance(t, torch.Tensor)] + list(self.memory.kv or ())
        return sum(t.nbytes for t in tensors)

    def rewind(self, length: int) -> None:
        self.caches.keep_before(length)


class DreamStage:
    def __init__(
        self,
        name: str,
        ckpt: DreamCheckpoint,
        width: int | None = None,
        valid: int | None = None,
        options: DreamOptions | None = None,
    ):
        """`width`, `valid`: the pipeline's vocabulary (see pipespec.stages.vocabulary). `options`: its forwards'
        context and widths, and whether they are compiled (None: eager, at the checkpoint's context)."""
        self.name = name
        self.drafter = ckpt.drafter
        self.embed = ckpt.embed  # [V, H]
        self.lm_head = ckpt.lm_head  # [V, H]
        self.device = self.embed.device
        self.keep_fraction = ckpt.keep_fraction
        self.fit = LogitsFit.of(name, self.lm_head.shape[0], width, valid)
        self.vocab_size = self.fit.width
        options = options if options is not None else DreamOptions(compile=False)
        self.refresh = options.refresh
        self.shapes = Shapes.of(options, ckpt.max_context, self.device, target=False)
        self.forwards = Forwards(name, self._step, self.shapes, compiles(options), self.device)
        state_bytes = self.new_state().nbytes  # every request's state is the stage's capacity
        budget = kv_budget(self.device, options.kv_budget_gib)
        self.caches = KVPool(lambda size: self.new_state(), lambda size: state_bytes, self.shapes.capacity, budget)
        if self.forwards.compiled:
            self.forwards.warm_up(self.caches, 0)

    @classmethod
    def from_spec(cls, spec: StageSpec, at: BuildContext = ALONE) -> DreamStage:
        """The checkpoint in `spec.model`, in `spec.dtype` on `spec.device`; its logits fit `at.width` and `at.valid`.
        Its forwards are warmed up (compiled, unless its options say otherwise) before this returns."""
        ckpt = load(spec.model, DTYPES[spec.dtype], stage_device(spec.name, spec.device))
        column_major(ckpt.drafter)  # for inference only: a training loop keeps its own parameters
        ckpt.lm_head = column_major_weight(ckpt.lm_head)  # [V, H], laid out as the drafter's weights
        return cls(spec.name, ckpt, at.width, at.valid, spec.options if spec.options is not None else DreamOptions())

    def open(self, request: RequestSpec) -> DreamSession:
        self.caches.check(self.name, self.shapes.capacity)
        return DreamSession(self, request.prompt_token_ids)

    def admits(self, request: RequestSpec) -> bool:
        """Whether one more request's state fits the stage's KV budget now (pipespec.engine.stage.AdmittingStage)."""
        return self.caches.admits(self.shapes.capacity)

    @property
    def kv_use(self) -> float:
        return self.caches.use

    def new_state(self) -> DraftState:
        """An empty state at the stage's capacity (ordinary tensors, even when asked for in inference mode:
        a later step outside it may change them)."""
        capacity = self.shapes.capacity
        project = self.drafter.block1.project if self.drafter.config.cross_attention else None
        with torch.inference_mode(False):
            memory = FeatureMemory(self.drafter.config, capacity, self.device, self.embed.dtype, project)
            return DraftState(self.drafter.new_caches(capacity), memory)

    def draft(self, state: DraftState, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed inputs [1, n, H] at positions [n] after `state`'s caches -> f [1, n, H], then kept in the
        memory as own features (after the step has read it). A forward's padding rows store theirs past
        the request's end too: the session's next forward drops own entries from its `keep` first."""
        memory = state.memory
        kv = (memory.kv[0][None], memory.kv[1][None]) if memory.kv is not None else None
        f, _ = self.drafter(inputs, positions, memory.features[None], memory.positions, state.caches, kv, memory.held)
        memory.put_own(positions, f[0])
        return f

    def _step(self, state: DraftState, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        """ids [1, w] at positions [w] -> (logits [1, w, V])."""
        return (self.draft(state, self.embed[ids], positions) @ self.lm_head.T,)

    def forward_batch(self, feeds: Sequence[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every feed's forward as one (pipespec.engine.stage.BatchingStage): one request's compiled at its width;
        several requests' packed into one eager forward (`DreamDrafter.forward_packed`: a drafter's logits pick
        drafts, never the answer, so they need not be the same bits as alone). The EAGLE-style ablation runs them
        one by one."""
        if len(feeds) == 1 or not self.drafter.config.cross_attention:
            return [(f.session.forward(f.keep, f.tokens), NO_SIDES) for f in feeds]
        sessions = [f.session for f in feeds]
        starts = [s.begin(f.keep, f.tokens) for s, f in zip(sessions, feeds)]
        for s in sessions:
            self.shapes.check_context(self.name, s.fed)
        logits = self._packed([(s.state, s.tokens[start : s.fed], start) for s, start in zip(sessions, starts)])
        return [(s.end(rows, len(f.tokens)), NO_SIDES) for s, f, rows in zip(sessions, feeds, logits)]

    def forward_rows(self, rows: int) -> int:
        return rows  # packed unpadded (one request alone: compiled at its width)

    @torch.inference_mode()
    def _packed(self, work: Sequence[tuple[DraftState, Sequence[int], int]]) -> list[torch.Tensor]:
        """Each (state, ids, first position) fed in one forward -> each one's logits [n, V]."""
        ids: list[int] = []
        positions: list[int] = []
        spans = []
        for _, tokens, start in work:
            spans.append(slice(len(ids), len(ids) + len(tokens)))
            ids += tokens
            positions += range(start, start + len(tokens))
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        requests = []
        for (state, _, _), rows in zip(work, spans):
            state.caches.keep_before(positions[rows.start])
            memory = state.memory
            requests.append((rows, state.caches, Memory((memory.kv[0][None], memory.kv[1][None]), memory.positions, memory.held)))
        f = self.drafter.forward_packed(self.embed[ids_t][None], positions_t, requests)[0]  # [T, H]
        for (state, _, _), rows in zip(work, spans):  # kept as own features once every request's step has read its memory
            state.memory.put_own(positions_t[rows], f[rows])
        logits = f @ self.lm_head.T  # [T, V]
        return [logits[rows] for rows in spans]


class DreamSession:
    def __init__(self, stage: DreamStage, prompt: Sequence[int]):
        self.stage = stage
        self.tokens = list(prompt)  # context ids: the target's prompt, then generated tokens
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]
        self.state: DraftState | None = stage.caches.take(stage.shapes.capacity)  # None once closed: the pool's again
        self.state.memory.clear()
        self.fed = 0  # context positions the caches cover (kept ones; dropped image positions count too)
        self.stale_from: int | None = None  # with `refresh`: an own memory entry here was replaced after later positions read it
        self.prefill_embeddings: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None  # [P - 1] bool: prompt positions kept (compression)

    def add_features(self, features: TargetFeatures) -> None:
        """Compute thread: take the target's features (prefill first, then per verification)."""
        if self.state is None:  # closed: the state may serve another request now
            return
        memory = self.state.memory
        device, dtype = self.stage.device, self.stage.embed.dtype  # features may come from another device
        if features.prefill is not None:
            pre = features.prefill
            image_mask = pre.image_mask.to(device)
            self.kept = kept_positions(image_mask, pre.attention_received, self.stage.keep_fraction)
            self.prefill_embeddings = pre.embeddings.to(device, dtype)
            positions = self.kept.nonzero().squeeze(-1).tolist()
            memory.put_target(positions, pre.hidden.to(device, dtype)[self.kept])
            return
        positions = range(features.start, features.start + len(features.hidden))
        replaced = memory.put_target(positions, features.hidden.to(device, dtype))
        if self.stage.refresh and replaced is not None and replaced + 1 < self.fed:
            self.stale_from = replaced if self.stale_from is None else min(self.stale_from, replaced)

    @torch.inference_mode()
    def _prefill(self) -> None:
        """The kept prompt positions, eager at the prompt's own length, fed the target's merged input embeddings."""
        assert self.state is not None and self.prefill_embeddings is not None and self.kept is not None, "prefill features first"
        positions = self.kept.nonzero().squeeze(-1)  # [k]
        self.state.rewind(0)
        self.stage.draft(self.state, self.prefill_embeddings[self.kept][None], positions)
        self.fed = self.prompt_len - 1

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        start = self.begin(keep, tokens)
        (logits,) = self.stage.forwards(self.state, start, self.tokens[start : self.fed])  # [fed - start, V]
        return self.end(logits, len(tokens))

    def begin(self, keep: int, tokens: Sequence[int]) -> int:
        """Before a forward that feeds `tokens` after `keep` context tokens: the prompt prefilled first if it is
        not yet, own features from `keep` on dropped; -> where the forward starts (before `keep` to refresh stale
        keys). The forward feeds self.tokens[start : self.fed]."""
        name = self.stage.name
        if self.state is None:
            raise RuntimeError(f"stage {name!r}: the session is closed")
        if self.fed == 0 and self.prompt_len > 1 and len(self.kept):
            self._prefill()
        check_keep(name, keep, self.fed)
        start = keep if self.stale_from is None else max(self.prompt_len - 1, min(keep, self.stale_from + 1))
        assert start >= self.prompt_len - 1, (start, self.prompt_len)
        self.stale_from = None
        self.state.memory.drop_own_from(keep)  # tokens before `keep` are unchanged: their own features still hold
        self.tokens[keep:] = list(tokens)
        self.fed = keep + len(tokens)
        return start

    def end(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        """After the forward: its logits [fed - start, V] -> the last n rows', at the pipeline's width [n, V]."""
        check_length(self.stage.name, self.state.length, self.fed)
        return self.stage.fit(logits[-n:].float())

    def close(self) -> None:
        if self.state is not None:
            self.stage.caches.give(self.state)
        self.state = None
