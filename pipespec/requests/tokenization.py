"""Tokenizers: loading one per model directory, checking that stages share one, decoding incrementally.

Every stage must speak the target's token ids. `check_shared_tokenizer` loads each model stage's
tokenizer (cheap: no weights) and compares vocabularies before any model loads, so a mismatch is a
clear error at config time naming both stages, never garbage at run time.
"""

from __future__ import annotations

import logging
from typing import Any

from pipespec.config import PipelineConfig
from pipespec.errors import ConfigError
from pipespec.requests.chat import ChatMessage
from pipespec.schema.kinds import kind_of

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str, where: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}: cannot load a tokenizer from {model_dir!r}: {e}") from e


def check_shared_tokenizer(config: PipelineConfig) -> Any | None:
    """Return the target's tokenizer (None for mock pipelines); raise if any stage's differs."""
    model_stages = [(i, s) for i, s in enumerate(config.stages) if kind_of(s).loads_model]
    if not model_stages:
        return None
    tokenizers = {i: load_tokenizer(s.model, f"stages[{i}] ({s.name})") for i, s in model_stages}
    target_index = len(config.stages) - 1
    ref_index = target_index if target_index in tokenizers else model_stages[-1][0]
    ref, ref_spec = tokenizers[ref_index], config.stages[ref_index]
    ref_vocab = ref.get_vocab()
    for i, tok in tokenizers.items():
        vocab = tok.get_vocab()
        if vocab != ref_vocab:
            spec = config.stages[i]
            differing = sorted(set(vocab.items()) ^ set(ref_vocab.items()))[:3]
            raise ConfigError(
                f"stages[{i}] ({spec.name}): tokenizer of {spec.model!r} ({len(vocab)} tokens) differs from "
                f"the one of stage {ref_spec.name!r} at {ref_spec.model!r} ({len(ref_vocab)} tokens); "
                f"first differing entries: {differing}. All stages must share the target's tokenizer."
            )
    return ref


def encode_prompt(tokenizer: Any, messages: tuple[ChatMessage, ...]) -> list[int]:
    """A text conversation -> token ids, through the chat template when the tokenizer has one (each
    message's content as one string, as text models' templates read it); without one, the messages'
    texts joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        template = [{"role": m.role, "content": m.text} for m in messages]
        return list(tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=True, return_dict=False))
    return list(tokenizer.encode("\n".join(m.text for m in messages)))


class IncrementalDetokenizer:
    """Streams text for a growing list of ids, decoding only a short window per token.

    The classic prefix/read offset scheme (as in TGI and vLLM): decode the last few ids with and
    without the new one and emit the difference. A character split over several tokens (byte-level
    BPE: an emoji, an accented or CJK character) decodes to U+FFFD until its last byte comes, so text
    ending in U+FFFD is held back until a later token completes it; `flush` emits whatever is still
    held. What `push` returns is never revised: the pieces streamed so far are always a prefix of the
    decode of the ids so far, and all the pieces (and `flush`) add up to the full decode. A U+FFFD
    streams only where that full decode has it too: bytes that are not UTF-8 (a sampled model can begin
    a character and continue with something else: "\ufffd four"), emitted once the next token shows
    that nothing can complete them.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""
