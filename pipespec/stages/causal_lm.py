"""Any Hugging Face causal LM as a stage: a tiny drafter, or a text target.

Loaded from a directory with `AutoModelForCausalLM.from_pretrained` (bf16 by default). Each request owns a `StaticKV` sized to what it
can use, within the stage's KV budget (pipespec.stages.kv_pool); the prompt goes in by chunks, eager, several
requests' in one forward between the steps (pipespec.engine.stage.ChunkedPrefillStage), and every later forward runs at the stage's fixed shapes, compiled, the forwards of up to `max_batch` requests packed into one (`forward_batch`,
pipespec.stages.packed_forwards); a rollback sets the cache's length. The length invariant is asserted
after every call. Logits come out at the pipeline's width (pipespec.stages.vocabulary), on the stage's
device (pipespec.stages.device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from pipespec.engine.stage import NO_SIDES, Feed, next_chunk, open_whole
from pipespec.protocol.messages import RequestSpec
from pipespec.stages.build_context import ALONE, BuildContext
from pipespec.stages.device import stage_device
from pipespec.stages.model_stage import PackedModelStage, PackedSession, eos_ids
from pipespec.stages.packing import use_packed_attention
from pipespec.stages.vocabulary import LogitsFit
from pipespec.stages.weight_layout import column_major

if TYPE_CHECKING:
    from pipespec.config import StageSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CausalLMStage(PackedModelStage):
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
        self.eos_token_ids = eos_ids(self.model, self.model.config.eos_token_id)
        self._pack(spec, at, getattr(self.model.config, "max_position_embeddings", None), lock)

    def cache_size(self, request: RequestSpec) -> int:
        return self.positions(len(request.text_prompt), request)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        """Packed ids [1, T] at positions [1, T] -> (logits [1, T, V'])."""
        return (self.model(input_ids=ids, position_ids=positions, use_cache=False).logits,)

    def forward_batch(self, feeds: Sequence[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every feed's forward as one (pipespec.engine.stage.BatchingStage)."""
        return [(self.fit(logits.float()), NO_SIDES) for (logits,) in self.forwards.run(feeds)]  # [n, V] each

    def forward_rows(self, rows: int) -> int:
        return self.forwards.bucket(rows)

    def begin(self, request: RequestSpec) -> CausalLMSession:
        """`request` opened with its prompt unfed (pipespec.engine.stage.ChunkedPrefillStage)."""
        prompt = request.text_prompt
        if len(prompt) > self.max_context:
            raise ValueError(
                f"stage {self.name!r}: a prompt of {len(prompt)} tokens exceeds its max_context of {self.max_context}"
            )
        size = self.cache_size(request)
        self.caches.check(self.name, size)
        return CausalLMSession(self, prompt, size)

    @torch.inference_mode()
    def prefill_batch(self, sessions: Sequence[CausalLMSession]) -> None:
        """Each session's next prompt chunk, all in one forward (pipespec.engine.stage.ChunkedPrefillStage)."""
        embed = self.model.get_input_embeddings()
        chunks = []
        for session in sessions:
            ids = torch.tensor(session.prompt[next_chunk(self, session)], dtype=torch.long, device=self.device)
            chunks.append((session.cache, embed(ids)))  # [n, H]
        self.forwards.prefill(chunks, self.model.get_decoder())
        for session, (_, embeds) in zip(sessions, chunks):
            session.unfed_prompt -= len(embeds)

    def open(self, request: RequestSpec) -> CausalLMSession:
        return open_whole(self, request)


class CausalLMSession(PackedSession):
    def __init__(self, stage: CausalLMStage, prompt: Sequence[int], cache_size: int):
        super().__init__(stage, prompt, cache_size)
        self.unfed_prompt = len(prompt) - 1  # fed in chunks (`CausalLMStage.prefill_batch`)
