"""The demo target's projector, seeded to write each patch as the words for what the tower saw there.

The first demo target's tower carried each cell's colour (a linear probe reads it from the projector's
input at 0.97 per patch), yet its language model called almost every shape "green": 2,000 steps of
language-model training over a randomly initialised projector taught it to count, a large and common
direction of the features, but never to find the colour, the size or the word, which live in small
directions of features whose scale (rms 3.2 around a large common mean) dwarfs the text embeddings
(rms 0.02). A language model trained from scratch learns early to copy words from its context (the
question's subject into the answer); a picture written in words is read the same way. So ours starts
as LLaVA's first stage would leave it, aligned to the word embeddings:

- `fit_heads`: linear heads fitted on exactly what the projector receives (the configured layer,
  the class token first) over fresh scenes: per patch, its cell's kind, colour, size and word; from
  the class token, the background and the number of shapes (the dense pretraining's labels);
- `seed_projector`: the first layer's first hidden units are those heads, centred and scaled to unit
  spread, so after the GELU each is about 1 where its class is seen and about 0 elsewhere; the second
  layer maps each such unit to the input embedding of its word (" red", " circle", " large", "sky",
  " light blue", " three"), so an image token starts as the bag of the words for its cell. The other
  hidden units see standardised features and start silent; training moves all of it.

The architecture is LLaVA's own (`LlavaMultiModalProjector`): only the starting point changes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from demo.tower import DenseProbe, scene_batches
from demo.world import BACKGROUNDS, COLOURS, KINDS_OF_SHAPE, NUMBERS, SIZES, WORDS, random_scene, render

# The words of the heads' classes, in DenseProbe's order (cell heads: "" = nothing there).
HEAD_WORDS: tuple[tuple[str, ...], ...] = (
    ("", *(" " + k for k in KINDS_OF_SHAPE)),
    ("", *(" " + c for c in COLOURS)),
    ("", *(" " + s for s in SIZES)),
    ("", *WORDS),  # printed words follow an opening quote: no space
    tuple(" " + b for b in BACKGROUNDS),
    tuple(" " + n for n in NUMBERS),
)


@torch.no_grad()
def projector_inputs(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """[B, T, H] what `model` (a LlavaForConditionalGeneration) feeds its projector for `pixels`: the
    configured vision layer, with the class token first unless the strategy drops it."""
    config = model.config
    states = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[config.vision_feature_layer]
    return states[:, 1:] if config.vision_feature_select_strategy == "default" else states


def fit_heads(model: nn.Module, image_processor, size: int, patch: int, steps: int, seed: int) -> DenseProbe:
    """Linear heads fitted on the frozen projector input of `model` over fresh scenes (class token first)."""
    if model.config.vision_feature_select_strategy != "full":
        raise ValueError("the heads read the background from the class token: the projector must receive it (strategy 'full')")
    torch.manual_seed(seed)
    probe = DenseProbe(model.config.vision_config.hidden_size)
    optimiser = torch.optim.Adam(probe.parameters(), 1e-2)
    data = scene_batches(image_processor, size, patch, 64, seed + 1)
    for _ in range(steps):
        pixels, cells, background, count = next(data)
        loss, _ = probe.loss(projector_inputs(model, pixels), cells, background, count)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return probe


def word_vectors(tokenizer, embeddings: torch.Tensor) -> torch.Tensor:
    """[K, D] the input embedding of each head class's word (the mean over its tokens; zero for "")."""
    rows = []
    for words in HEAD_WORDS:
        for word in words:
            ids = tokenizer(word, add_special_tokens=False)["input_ids"] if word else []
            rows.append(embeddings[ids].mean(0) if ids else torch.zeros(embeddings.shape[1]))
    return torch.stack(rows).float()


@torch.no_grad()
def seed_projector(projector: nn.Module, probe: DenseProbe, features: torch.Tensor, words: torch.Tensor, seed: int) -> None:
    """Seed `projector` (linear_1, GELU, linear_2) from `probe`, the statistics of `features` [N, H]
    (projector inputs over fresh scenes) and `words` [K, D] (each head class's word embedding)."""
    heads = [*probe.cell, probe.background, probe.count]
    weight = torch.cat([h.weight for h in heads]).float()  # [K, H]
    bias = torch.cat([h.bias for h in heads]).float()  # [K]
    first, second = projector.linear_1, projector.linear_2
    k, hidden = weight.shape[0], first.weight.shape[0]
    if k > hidden or words.shape != (k, second.weight.shape[0]):
        raise ValueError(f"{k} heads and words {tuple(words.shape)} do not fit a projector of {hidden} hidden units")
    logits = features @ weight.T + bias  # [N, K]
    spread = logits.std(0).clamp_min(1e-3)
    mean, std = features.mean(0), features.std(0).clamp_min(1e-3)  # [H]
    generator = torch.Generator().manual_seed(seed)
    random = torch.randn(hidden - k, weight.shape[1], generator=generator) / weight.shape[1] ** 0.5  # on standardised input
    first.weight.copy_(torch.cat([weight / spread[:, None], random / std]))
    first.bias.copy_(torch.cat([(bias - logits.mean(0)) / spread, -(random / std) @ mean]))
    second.weight.zero_()
    second.weight[:, :k] = words.T  # [D, K]: head unit -> its word's embedding
    second.bias.zero_()


def fresh_pixels(image_processor, size: int, scenes: int, seed: int) -> torch.Tensor:
    """[scenes, 3, size, size] pictures of fresh random scenes, processed."""
    rng = np.random.default_rng([seed, 2])
    return image_processor(images=[render(random_scene(rng), size) for _ in range(scenes)], return_tensors="pt")["pixel_values"]
