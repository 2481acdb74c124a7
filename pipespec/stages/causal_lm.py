"""Any Hugging Face causal LM as a stage: a tiny drafter, or a text target.

Loaded from a directory with `AutoModelForCausalLM.from_pretrained` (bf16 by default: on this CPU a
4-token verification costs about what one token does). Each request owns a `StaticKV` sized to what it
can use, within the stage's KV budget (pipespec.stages.kv_pool); the prompt is prefilled eagerly, and
every later forward runs at the stage's fixed shapes, compiled, the forwards of up to `max_batch` requests packed into one (`forward_batch`,
pipespec.stages.packed_forwards); a rollback sets the cache's length. The length invariant is asserted
after every call. Logits come out at the pipeline's width (pipespec.stages.vocabulary), on the stage's
device (pipespec.stages.device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from pipespec.engine.stage import NO_SIDES, Feed
from pipespec.protocol.messages import RequestSpec
from pipespec.stages.build_context import ALONE, BuildContext
from pipespec.stages.device import kv_budget, stage_device
from pipespec.stages.forwards import Shapes, compiles
from pipespec.stages.kinds import ModelOptions
from pipespec.stages.packed_forwards import PackedForwards
from pipespec.stages.packing import prefill, use_packed_attention
from pipespec.stages.static_kv import static_pool
from pipespec.stages.vocabulary import LogitsFit
from pipespec.stages.weight_layout import column_major

if TYPE_CHECKING:
    from pipespec.config import StageSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CausalLMStage:
    def __init__(self, spec: StageSpec, at: BuildContext = ALONE, model: PreTrainedModel | None = None):
        """The model in `spec.model` (or `model`, already built: a random-weight shape in an experiment), in
        `spec.dtype` on `spec.device`; its logits fit `at.width` and `at.valid`. Its forwards are warmed up
        (compiled, unless its options say otherwise) before this returns."""
        name = self.name = spec.name
        self.device = stage_device(name, spec.device)  # before any weights load
        self.dtype = DTYPES[spec.dtype]
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=self.dtype)
        self.model = column_major(model.to(self.device, self.dtype).eval())
        lock = use_packed_attention(self.model)
        self.fit = LogitsFit.of(name, self.model.get_output_embeddings().out_features, at.width, at.valid)
        self.vocab_size = self.fit.width
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        options = spec.options if spec.options is not None else ModelOptions()
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.shapes = Shapes.of(options, limit, self.device, target=len(at.chain) <= 1)
        self.max_context = self.shapes.context
        self.forwards = PackedForwards(name, self._step, self.shapes, spec.max_batch, compiles(options), self.device, lock)
        budget = kv_budget(self.device, options.kv_budget_gib)
        self.caches = static_pool(self.model.config, self.shapes.capacity, self.dtype, self.device, budget)
        self.forwards.warm_up(self.caches, min(self.eos_token_ids, default=0))

    def cache_size(self, request: RequestSpec) -> int:
        """The positions of `request`'s cache here: its prompt, its new tokens, a forward's padding."""
        return self.caches.size_for(len(request.text_prompt) + request.max_new_tokens + self.shapes.widths[-1])

    def admits(self, request: RequestSpec) -> bool:
        """Whether `request`'s cache fits the stage's KV budget now (pipespec.engine.stage.AdmittingStage)."""
        return self.caches.admits(self.cache_size(request))

    @property
    def kv_use(self) -> float:
        return self.caches.use

    def _step(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        """Packed ids [1, T] at positions [1, T] -> (logits [1, T, V'])."""
        return (self.model(input_ids=ids, position_ids=positions, use_cache=False).logits,)

    def forward_batch(self, feeds: Sequence[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every feed's forward as one (pipespec.engine.stage.BatchingStage)."""
        return [(self.fit(logits.float()), NO_SIDES) for (logits,) in self.forwards.run(feeds)]  # [n, V] each

    def open(self, request: RequestSpec) -> CausalLMSession:
        prompt = request.text_prompt
        if len(prompt) > self.max_context:
            raise ValueError(
                f"stage {self.name!r}: a prompt of {len(prompt)} tokens exceeds its max_context of {self.max_context}"
            )
        size = self.cache_size(request)
        self.caches.check(self.name, size)
        session = CausalLMSession(self, prompt, size)
        try:
            if len(prompt) > 1:
                session.prefill(prompt[:-1])
        except BaseException:
            session.close()  # its cache goes back: a failed prefill holds no memory
            raise
        return session


class CausalLMSession:
    def __init__(self, stage: CausalLMStage, prompt: Sequence[int], cache_size: int):
        self.stage = stage
        self.cache = stage.caches.take(cache_size)
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int]) -> None:
        """Eager, at the prompt's own length: one piece of a packed forward."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.stage.device)  # [1, P - 1]
        with prefill(self.stage.model, self.cache, len(tokens)):
            self.stage.model(input_ids=ids, use_cache=False, logits_to_keep=1)

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        ((logits, _),) = self.stage.forward_batch([Feed(self, keep, tokens)])
        return logits  # [n, V]

    def close(self) -> None:
        if self.cache is not None:
            self.stage.caches.give(self.cache)
        self.cache = None
