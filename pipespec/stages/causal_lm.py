"""Any Hugging Face causal LM as a stage: a tiny drafter, or a text target.

Loaded from a directory with `AutoModelForCausalLM.from_pretrained` (bf16 by default: on this CPU a
4-token verification costs about what one token does). Each request owns a `DynamicCache`;
`forward` crops it to `keep` tokens (transformers 5: `crop(-n)` removes n tokens) and asserts the
length invariant after every call. Logits come out at the pipeline's width (pipespec.stages.vocabulary),
on the stage's device (pipespec.stages.device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pipespec.engine.stage import check_keep, check_length
from pipespec.protocol.messages import RequestSpec
from pipespec.stages.build_context import ALONE, BuildContext
from pipespec.stages.device import stage_device
from pipespec.stages.vocabulary import LogitsFit

if TYPE_CHECKING:
    from pipespec.config import StageSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CausalLMStage:
    def __init__(self, spec: StageSpec, at: BuildContext = ALONE):
        """The model in `spec.model`, in `spec.dtype` on `spec.device`; its logits fit `at.width` and `at.valid`."""
        name = self.name = spec.name
        self.device = stage_device(name, spec.device)  # before any weights load
        self.model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=DTYPES[spec.dtype]).to(self.device).eval()
        self.fit = LogitsFit.of(name, self.model.get_output_embeddings().out_features, at.width, at.valid)
        self.vocab_size = self.fit.width
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])

    def open(self, request: RequestSpec) -> CausalLMSession:
        prompt = request.text_prompt
        session = CausalLMSession(self, prompt)
        if len(prompt) > 1:
            session.forward(0, prompt[:-1])
        return session

    @torch.inference_mode()
    def run(self, cache: DynamicCache, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        positions = torch.arange(keep, keep + len(tokens), device=self.device)[None]  # [1, n]
        out = self.model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True)
        return self.fit(out.logits[0].float())  # [n, V]


class CausalLMSession:
    def __init__(self, stage: CausalLMStage, prompt: Sequence[int]):
        self.stage = stage
        self.cache = DynamicCache()
        self.prompt_len = len(prompt)
        self.last_prompt_token = prompt[-1]

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        name = self.stage.name
        cache_len = self.cache.get_seq_length()
        check_keep(name, keep, cache_len)
        if keep < cache_len:
            self.cache.crop(keep - cache_len)
            check_length(name, self.cache.get_seq_length(), keep)
        logits = self.stage.run(self.cache, keep, tokens)
        check_length(name, self.cache.get_seq_length(), keep + len(tokens))
        return logits

    def close(self) -> None:
        self.cache = DynamicCache()
