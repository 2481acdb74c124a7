"""The demo target's projector, seeded from what the tower's pretraining learnt to read out.

The first demo target's tower carried each cell's colour (a linear probe reads it from the projector's
input at 0.97 per patch), yet its language model called almost every shape "green": 2,000 steps of
language-model training over a randomly initialised projector taught it to count (a large, common
direction of the features) but never found the colour, the size or the word, which live in small
directions of features whose scale (rms 3.2, a large common mean) dwarfs the text embeddings (rms
0.02). A LLaVA projector is free to start anywhere, so ours starts where the pretraining left off:

- its first hidden units are the dense probe's heads (the cell's kind, colour, size and word; the
  background and the number of shapes, which the class token answers), scaled to unit spread, so
  after the GELU every attribute is a sparse, large code at every image token;
- the other hidden units see standardised features (each feature's mean and spread folded in);
- the second layer stays random; training moves all of it.

The architecture is LLaVA's own (`LlavaMultiModalProjector`): only the starting point changes.
"""

from __future__ import annotations

import torch
from torch import nn

from demo.tower import DenseProbe


@torch.no_grad()
def seed_projector(projector: nn.Module, probe: DenseProbe, features: torch.Tensor, seed: int) -> int:
    """Set `projector.linear_1` from `probe` and the statistics of `features` [N, H] (the tower's
    projector input over fresh scenes); -> the number of hidden units that are probe heads."""
    heads = [*probe.cell, probe.background, probe.count]
    weight = torch.cat([h.weight for h in heads]).float()  # [K, H]
    bias = torch.cat([h.bias for h in heads]).float()  # [K]
    logits = features @ weight.T + bias  # [N, K]
    spread = logits.std(0).clamp_min(1e-3)
    first = projector.linear_1
    k, hidden = weight.shape[0], first.weight.shape[0]
    if k > hidden:
        raise ValueError(f"the probe has {k} heads, more than the projector's {hidden} hidden units")
    mean, std = features.mean(0), features.std(0).clamp_min(1e-3)  # [H]
    generator = torch.Generator().manual_seed(seed)
    random = torch.randn(hidden - k, weight.shape[1], generator=generator) / weight.shape[1] ** 0.5  # on standardised input
    first.weight.copy_(torch.cat([weight / spread[:, None], random / std]))
    first.bias.copy_(torch.cat([(bias - logits.mean(0)) / spread, -(random / std) @ mean]))
    return k


@torch.no_grad()
def projector_inputs(model: nn.Module, image_processor, size: int, scenes: int, seed: int) -> torch.Tensor:
    """[scenes * tokens, H] what `model` (a LlavaForConditionalGeneration) feeds its projector, over
    fresh random scenes: the configured vision layer, with the class token unless the strategy drops it."""
    import numpy as np

    from demo.world import random_scene, render

    rng = np.random.default_rng([seed, 2])
    pixels = image_processor(images=[render(random_scene(rng), size) for _ in range(scenes)], return_tensors="pt")["pixel_values"]
    config = model.config
    states = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[config.vision_feature_layer]
    if config.vision_feature_select_strategy == "default":
        states = states[:, 1:]
    return states.flatten(0, 1).float()
