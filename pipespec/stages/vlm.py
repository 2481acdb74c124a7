"""Any Hugging Face image-text-to-text model as a stage: the VLM target.

Loaded with `AutoModelForImageTextToText.from_pretrained` (LLaVA, LLaVA-NeXT, Idefics3/SmolVLM,
Qwen2-VL/2.5-VL, Gemma 3, Mistral 3, ...). The front door has already run the model's processor:
the request carries the expanded prompt ids and the pixel arrays (`ImageInputs`). `open` prefills
every prompt token but the last together with the pixel arrays (the image is encoded once, here);
every later forward feeds token ids only, at the stage's fixed widths over a per-request `StaticKV`
whose length a rollback sets, compiled, the forwards of up to `max_batch` requests packed into one
(`forward_batch`, pipespec.stages.packed_forwards). Models with multimodal rotary positions (Qwen2-VL)
compute a request's position offset in its prefill, from the image's grid; the session keeps it
(`shift`) and its later forwards give the model their rotary positions, offset, so requests with
different images share one compiled forward.

What the DREAM drafter needs of the target is exposed on the session: `prefill_features` holds the merged
input embeddings, the last layer's post-norm hidden states and (when a drafter reads them, the build
context's `sends_features`) the last-layer attention each prompt position received; `hidden` holds the
post-norm hidden states of the tokens fed by the latest `forward`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import AutoModelForImageTextToText

from pipespec.engine.stage import NO_SIDES, Feed, next_chunk, open_whole
from pipespec.errors import ConfigError
from pipespec.protocol.messages import ImageInputs, PrefillFeatures, RequestSpec
from pipespec.stages.build_context import ALONE, BuildContext
from pipespec.stages.causal_lm import DTYPES
from pipespec.stages.device import stage_device
from pipespec.stages.dream.compression import attention_received
from pipespec.stages.model_stage import PackedModelStage, PackedSession, eos_ids
from pipespec.stages.packing import prefill, use_packed_attention
from pipespec.stages.vocabulary import LogitsFit
from pipespec.stages.weight_layout import column_major

if TYPE_CHECKING:
    from pipespec.config import StageSpec

log = logging.getLogger(__name__)

PER_TOKEN = ("token_type_ids", "mm_token_type_ids")  # processor arrays with one entry per prompt token [1, P]


class _Embedded(Exception):
    """The model's forward reached its language model: the input embeddings are taken (`_Taps.embeddings`)."""


class _Taps:
    """Forward hooks on the language model: its input embeddings, final-norm output, last-layer attention."""

    def __init__(self, model: torch.nn.Module, image_attention: bool):
        decoder = model.get_decoder()
        self.stop = False  # raise `_Embedded` at the language model's door (`VLMStage.embed`)
        self.embeddings: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.attention: tuple[torch.Tensor, ...] | None = None
        self.last_attention: torch.nn.Module | None = None
        decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True)
        decoder.norm.register_forward_hook(self._on_norm)
        if image_attention:  # its packed attention also returns its weights when asked (pipespec.stages.packing)
            attn = self.last_attention = decoder.layers[-1].self_attn
            attn.keep_weights = False  # set before the forwards compile: flipping it in a prefill then costs no recompile
            attn.register_forward_hook(self._on_attention)

    def _on_decoder(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.embeddings = kwargs.get("inputs_embeds")
        if self.stop:
            raise _Embedded

    def _on_norm(self, module: Any, args: tuple, output: torch.Tensor) -> None:
        self.hidden = output

    def _on_attention(self, module: Any, args: tuple, output: tuple) -> None:
        self.attention = output[1]  # per piece [1, heads, w, C] (pipespec.stages.packing)


class VLMStage(PackedModelStage):
    def __init__(self, spec: StageSpec, at: BuildContext = ALONE):
        """The model in `spec.model`, in `spec.dtype` on `spec.device`; its logits fit `at.width` and `at.valid`.
        When a DREAM drafter reads its features (`at.sends_features`), prefill also computes the last
        layer's attention weights (its visual token compression ranks image positions by them)."""
        name = self.name = spec.name
        self.device = stage_device(name, spec.device)  # before any weights load
        self.dtype = DTYPES[spec.dtype]
        try:
            model = AutoModelForImageTextToText.from_pretrained(spec.model, dtype=self.dtype)
        except ValueError as e:  # a config class the auto mapping does not know: not an image-text model
            raise ConfigError(f"stage {name!r}: {spec.model!r} is not an image-text-to-text model: {e}") from e
        self.model = column_major(model.to(self.device).eval())
        config = self.model.config
        text = config.get_text_config()
        self.fit = LogitsFit.of(name, self.model.get_output_embeddings().out_features, at.width, at.valid)
        self.vocab_size = self.fit.width
        self.eos_token_ids = eos_ids(self.model, text.eos_token_id)
        image_token = getattr(config, "image_token_id", None)
        self.image_token_id = getattr(config, "image_token_index", None) if image_token is None else image_token
        lock = use_packed_attention(self.model)
        self.taps = _Taps(self.model, at.sends_features)
        self.inner = self.model.model
        self.has_rope_deltas = hasattr(self.inner, "rope_deltas")
        self._pack(spec, at, getattr(text, "max_position_embeddings", None), lock)

    def cache_size(self, request: RequestSpec) -> int:
        return self.positions(len(request.prompt_token_ids), request)

    def begin(self, request: RequestSpec) -> VLMSession:
        """`request` opened (pipespec.engine.stage.ChunkedPrefillStage): its prompt's input embeddings made, the image
        merged in, for its chunks; a model that makes its own prefill positions or mask (`chunks`) prefills whole here."""
        if len(request.prompt_token_ids) <= 1 and request.image is not None:
            raise ValueError(f"stage {self.name!r}: an image prompt needs more than its image tokens")
        size = self.cache_size(request)
        self.caches.check(self.name, size)
        session = VLMSession(self, request.prompt_token_ids, size)
        try:
            if len(request.prompt_token_ids) > 1 and self.chunks(request.image):
                session.embeddings = self.embed(session.prompt[:-1], request.image)
                session.unfed_prompt = len(session.embeddings)
            elif len(request.prompt_token_ids) > 1:
                session.prefill(request.image)
        except BaseException:
            session.close()  # its cache goes back: a failed prefill holds no memory
            raise
        return session

    def open(self, request: RequestSpec) -> VLMSession:
        return open_whole(self, request)

    def chunks(self, image: ImageInputs | None) -> bool:
        """Whether a prompt with `image` goes in by chunks of its input embeddings: unless the model makes its own
        rotary positions (Qwen2-VL) or the processor marks tokens for the model's own mask (Gemma 3's image blocks)."""
        return not self.has_rope_deltas and (image is None or not any(key in image.arrays for key in PER_TOKEN))

    @torch.inference_mode()
    def embed(self, ids: Sequence[int], image: ImageInputs | None) -> torch.Tensor:
        """A prompt's input embeddings [P, H], the image encoded and merged in by the model's own forward, stopped at
        its language model."""
        pixels = self.tensors(image) if image is not None else {}
        taps = self.taps
        with self.forwards.lock:
            taps.stop = True
            try:
                self.model(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=self.device), use_cache=False, **pixels)
            except _Embedded:
                pass
            else:
                raise RuntimeError(f"stage {self.name!r}: the model's forward never reached its language model")
            finally:
                taps.stop = False
        return taps.embeddings[0].detach()

    @torch.inference_mode()
    def prefill_batch(self, sessions: Sequence[VLMSession]) -> None:
        """Each session's next prompt chunk, all in one forward (pipespec.engine.stage.ChunkedPrefillStage); a session
        whose prompt is then in makes its prefill features."""
        chunks = []
        for session in sessions:
            chunks.append((session.cache, session.embeddings[next_chunk(self, session)]))  # [n, H]
        weights = self.taps.last_attention
        with self.forwards.lock:  # an eager forward: the last layer's weights may be kept for it alone
            if weights is not None:
                weights.keep_weights = True
            try:
                outs = self.forwards.prefill(chunks, self.model.get_decoder())
                kept = self.taps.attention
            finally:
                if weights is not None:
                    weights.keep_weights = False
        for i, (session, hidden) in enumerate(zip(sessions, outs)):
            session.took(hidden.detach(), None if weights is None else kept[i][0])

    def tensors(self, image: ImageInputs, prefill: int | None = None) -> dict[str, torch.Tensor]:
        """Processor arrays -> model inputs; per-token arrays ([1, P]) cut to `prefill` = P - 1 tokens if given."""
        out = {}
        for key, array in image.arrays.items():
            t = torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
            if prefill is not None and key in PER_TOKEN:
                t = t[:, :prefill]
            if t.is_floating_point():
                t = t.to(self.dtype)
            out[key] = t
        return out

    def _step(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed ids [1, T] at rotary positions [1, T] -> (logits [1, T, V'], post-norm hidden states [1, T, H])."""
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False)
        return out.logits, self.taps.hidden

    def forward_batch(self, feeds: Sequence[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every feed's forward as one (pipespec.engine.stage.BatchingStage); each session keeps its rows' hidden states."""
        for f in feeds:
            assert f.keep >= f.session.prompt_len - 1, (
                f"rollback into the prompt ({f.keep} < {f.session.prompt_len - 1}): the image is gone"
            )
        rows = []
        for f, (logits, hidden) in zip(feeds, self.forwards.run(feeds, [f.session.shift for f in feeds])):
            f.session.hidden = hidden.detach()
            rows.append((self.fit(logits.float()), NO_SIDES))  # [n, V]
        return rows

    def forward_rows(self, rows: int) -> int:
        return self.forwards.bucket(rows)


class VLMSession(PackedSession):
    def __init__(self, stage: VLMStage, prompt: Sequence[int], cache_size: int):
        super().__init__(stage, prompt, cache_size)
        self.shift = 0  # rotary positions past the prompt: cache positions + shift (Qwen2-VL's rope delta after an image)
        hidden = stage.model.get_input_embeddings().embedding_dim
        nothing = torch.empty(0, hidden, device=stage.device)
        empty = PrefillFeatures(nothing, nothing, torch.empty(0, dtype=torch.bool, device=stage.device))
        self.prefill_features: PrefillFeatures | None = empty  # replaced once the prompt is in (a 1-token prompt has none)
        self.hidden: torch.Tensor | None = None  # [n, H] post-norm, for the tokens of the last forward
        self.embeddings: torch.Tensor | None = None  # [P - 1, H]: the prompt's, while its chunks go in (`VLMStage.begin`)
        self.unfed_prompt = 0  # of them, not yet in the cache
        self._chunks: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # each chunk's hidden states and attention weights
        self.image_mask = torch.tensor(self.prompt[:-1], device=stage.device) == stage.image_token_id  # [P - 1] bool

    def took(self, hidden: torch.Tensor, weights: torch.Tensor | None) -> None:
        """A chunk of n tokens went in: its post-norm hidden states [n, H] and last-layer attention weights [heads, n, C]
        (None: not kept); after the last, the prompt's features are made."""
        self.unfed_prompt -= len(hidden)
        self._chunks.append((hidden, weights))
        if self.unfed_prompt:
            return
        length = self.prompt_len - 1
        hidden = torch.cat([h for h, _ in self._chunks])
        received = None
        if weights is not None:
            attention = torch.cat([w[..., :length] for _, w in self._chunks], dim=1)  # [heads, P - 1, P - 1]
            received = attention_received(attention, self.image_mask)
        self.prefill_features = PrefillFeatures(self.embeddings, hidden, self.image_mask, received)
        self.embeddings, self._chunks = None, []

    def prefill(self, image: ImageInputs | None) -> None:
        """Every prompt token but the last, with the image: the model's own forward, eager, at the prompt's length."""
        stage, taps = self.stage, self.stage.taps
        length = self.prompt_len - 1
        pixels = stage.tensors(image, length) if image is not None else {}
        ids = torch.tensor([self.prompt[:-1]], dtype=torch.long, device=stage.device)  # [1, P - 1]
        taps.attention = None
        if taps.last_attention is not None:
            taps.last_attention.keep_weights = True
        try:
            with torch.inference_mode(), prefill(stage.model, self.cache, length):  # the model makes its rotary positions
                self._with_rope_deltas(lambda: stage.model(input_ids=ids, use_cache=False, logits_to_keep=1, **pixels))
        finally:
            if taps.last_attention is not None:
                taps.last_attention.keep_weights = False
        hidden = taps.hidden[0].detach()
        image_mask = self.image_mask
        received = None
        if taps.attention is not None:
            received = attention_received(taps.attention[0][0, ..., :length], image_mask)  # keys past the prompt: masked
        self.prefill_features = PrefillFeatures(taps.embeddings[0].detach(), hidden, image_mask, received)

    def _with_rope_deltas(self, run: Callable[[], Any]) -> Any:
        """Run the prefill with no multimodal rotary offset on the model (Qwen2-VL keeps the one it computes
        there, from the image's grid), and keep the one it leaves as this request's `shift`."""
        inner = self.stage.inner
        if not self.stage.has_rope_deltas:
            return run()
        inner.rope_deltas = None
        out = run()
        self.shift = 0 if inner.rope_deltas is None else int(inner.rope_deltas.reshape(-1)[0])
        return out

    def close(self) -> None:
        super().close()
        self.prefill_features = None
        self.hidden = None
        self.embeddings, self._chunks = None, []
