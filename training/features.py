"""The target's features for training the DREAM drafter, computed online (no feature caches on disk).

One forward of the VLM target over prompt + answer gives, per position: the merged input embeddings,
every layer's hidden state, the last layer's post-norm hidden state and logits, and the attention
rows of the candidate layers. Per token and candidate layer the attention entropy (mean over heads)
is computed in fp32 (in fp16 an eps of 1e-8 underflows to NaN); the lowest-entropy layer's hidden
state is what the drafter's first block learns to predict (entropy-adaptive supervision).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipespec.stages.dream.compression import attention_received
from pipespec.stages.packing import prefill
from pipespec.stages.vlm import PER_TOKEN, VLMStage


@dataclass(frozen=True)
class SequenceFeatures:
    """One training sequence (prompt + answer, T tokens) as the target sees it."""

    ids: torch.Tensor  # [T]
    prompt_len: int
    embeddings: torch.Tensor  # [T, H] merged input embeddings
    hidden: torch.Tensor  # [T, H] last layer, post-norm
    logits: torch.Tensor  # [T, V]
    layer_hidden: torch.Tensor  # [L, T, H] each decoder layer's output
    entropy: torch.Tensor  # [C, T] fp32 attention entropy of the candidate layers
    candidates: tuple[int, ...]  # the C candidate layers
    image_mask: torch.Tensor  # [T] bool
    attention_received: torch.Tensor  # [P - 1] last-layer attention each prompt position got from the prompt

    def supervision(self, layer: float | None) -> torch.Tensor:
        """[T, H] the first block's regression target: per token the lowest-entropy candidate layer's
        hidden state (layer=None), or a fixed layer at that fraction of the depth (the ablations)."""
        n_layers = self.layer_hidden.shape[0]
        if layer is not None:
            return self.layer_hidden[round(layer * (n_layers - 1))]
        chosen = torch.tensor(self.candidates)[self.entropy.argmin(0)]  # [T]
        return self.layer_hidden[chosen, torch.arange(chosen.shape[0])]


class FeatureExtractor:
    """Hooks on a `VLMStage`'s model: every layer's output, the attention weights of the candidate
    layers and the last (the packed attention computes them when asked). A context manager: the hooks go when it closes.

        with FeatureExtractor(stage) as extract:
            feats = extract(prompt_ids, answer_ids, stage.tensors(image))
    """

    def __init__(self, stage: VLMStage):
        self.stage = stage
        decoder = stage.model.get_decoder()
        layers = decoder.layers
        self.candidates = tuple(range(len(layers) - 1)) or (0,)  # all but the last (which f regresses onto)
        self.last = len(layers) - 1
        self.weights: dict[int, torch.Tensor] = {}
        self.layer_out: list[torch.Tensor] = []
        self.handles = [layer.register_forward_hook(self._on_layer) for layer in layers]
        self.attention_modules = []
        for i in sorted({*self.candidates, self.last}):
            attn = (
                layers[i].self_attn
            )  # its packed attention returns each piece's weights while `keep_weights` (pipespec.stages.packing): one here
            self.handles.append(attn.register_forward_hook(lambda m, a, out, i=i: self._on_weights(i, out[1])))
            self.attention_modules.append(attn)

    def __enter__(self) -> FeatureExtractor:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.layer_out.clear()
        self.weights.clear()

    def _on_weights(self, layer: int, weights: tuple[torch.Tensor, ...] | None) -> None:
        if weights is not None:  # a forward that keeps them: the one piece's [1, heads, T, C]
            (self.weights[layer],) = weights

    def _on_layer(self, module, args, output) -> None:
        self.layer_out.append(output[0] if isinstance(output, tuple) else output)

    @torch.no_grad()
    def __call__(self, prompt_ids: list[int], answer_ids: list[int], image: dict[str, torch.Tensor]) -> SequenceFeatures:
        """image: the processor arrays as tensors for this prompt (see VLMStage.tensors)."""
        stage = self.stage
        ids = torch.tensor([list(prompt_ids) + list(answer_ids)], device=stage.device)
        T, P = ids.shape[1], len(prompt_ids)
        extra = {}
        for key, t in image.items():
            if key in PER_TOKEN:  # per-token arrays cover the whole sequence
                t = torch.cat([t, t.new_zeros(1, T - P)], dim=1)
            extra[key] = t
        self.weights.clear()
        self.layer_out.clear()
        for m in self.attention_modules:
            m.keep_weights = True
        if T > stage.caches.capacity:
            raise ValueError(f"a training sequence of {T} tokens is longer than the target's {stage.caches.capacity} positions")
        cache = stage.caches.take(stage.caches.size_for(T))  # the packed attention's keys and values, from position 0
        try:
            if stage.has_rope_deltas:
                stage.inner.rope_deltas = None
            with prefill(stage.model, cache, T):  # the whole sequence, as a prefill, with the model's own mask
                out = stage.model(input_ids=ids, use_cache=False, **extra)
        finally:
            stage.caches.give(cache)
            for m in self.attention_modules:
                m.keep_weights = False
        taps = stage.taps
        entropy = []
        for i in self.candidates:
            p = self.weights[i][0].float()  # [heads, T, C]: the cache's keys past T weigh 0
            entropy.append(-(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean(0))  # [T]
        image_mask = ids[0] == stage.image_token_id
        received = attention_received(self.weights[self.last][0][:, : P - 1, : P - 1], image_mask[: P - 1])  # as at prefill
        return SequenceFeatures(
            ids=ids[0],
            prompt_len=P,
            embeddings=taps.embeddings[0].float(),
            hidden=taps.hidden[0].float(),
            logits=out.logits[0].float(),
            layer_hidden=torch.stack(self.layer_out)[:, 0].float(),
            entropy=torch.stack(entropy),
            candidates=self.candidates,
            image_mask=image_mask,
            attention_received=received,
        )
