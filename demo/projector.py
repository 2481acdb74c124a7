"""How the demo target's projector starts: from the frozen tower's standardised features, with read-outs of
each cell's contents as its first rows.

LLaVA's projector maps the tower's last states into the language model's embedding space. Started at random,
it hands the language model whatever the tower's loudest directions are. On the demo's tower those are the
patch's size and brightness: after 1500 steps the target counted (0.88) and read the word (1.00) but named
the right colour 15% of the time, although a linear probe reads each cell's colour at 0.99 from the same
features (issue 29's note). So the projector starts from two folds into its first layer, both linear and
exact:

- the features' per-dimension mean and spread over fresh scenes (a few dimensions spread 45 where most
  spread 7), so that every dimension reaches the projector at unit spread;
- linear read-outs, fit here on those standardised features, of what is in the patch's cell (the shape's kind,
  colour and size, the word) and which cell it is, as the first rows, each head scaled to logits of unit
  spread. Each image token then starts as the labels of its cell, and a question's "the star" or "the bottom
  left" can find its token by content.

The other rows keep their random start; training moves all of them. Measured on its own (1500 steps, the
picture before the question) the read-outs did not lift the accuracy beyond one run's spread; the shipped
recipe (with `demo.train.answer_loss` and the picture after the question, 5000 steps in batches grouped by
length) names colours at 0.68, reads the word at 1.00 (experiments/results/demo_shapes).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from demo.tower import DenseProbe, cell_of_patches, scene_batches
from demo.world import IMAGE_SIZE

log = logging.getLogger(__name__)


def tower_features(model, image_processor, scenes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random scenes (`demo.tower.scene_batches`) through the target's (frozen) tower -> (features
    [S * N, H], labels [S * N, 5]: kind, colour, size, word (0 = nothing) and the patch's cell)."""
    patch = model.config.vision_config.patch_size
    pixels, cells, _, _ = next(scene_batches(image_processor, IMAGE_SIZE, patch, scenes, [seed, 7]))  # cells [S, N, 4]
    with torch.no_grad():
        states = model.model.vision_tower(pixel_values=pixels).last_hidden_state[:, 1:]  # [S, N, H]: the patches
    under = cell_of_patches(IMAGE_SIZE // patch).expand(scenes, -1)  # [S, N]
    labels = torch.cat([cells, under[..., None]], -1)  # [S, N, 5]
    return states.reshape(-1, states.shape[-1]).float(), labels.reshape(-1, labels.shape[-1])


def fit_readouts(x: torch.Tensor, labels: torch.Tensor, steps: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear read-outs of each label column of `labels` [M, 5] from standardised features `x` [M, H]: the
    dense probe's per-patch heads (`demo.tower.DenseProbe`), fit full-batch with AdamW -> (weight [R, H],
    bias [R]), R the classes of all heads together, each head's rows scaled so that its logits spread 1 over `x`."""
    probe = DenseProbe(x.shape[1])
    linears = [*probe.cell, probe.where]
    optimiser = torch.optim.AdamW([p for lin in linears for p in lin.parameters()], lr=0.05, weight_decay=0.01)
    for _ in range(steps):
        loss = sum(F.cross_entropy(lin(x), labels[:, j]) for j, lin in enumerate(linears))
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        accuracy = [(lin(x).argmax(-1) == labels[:, j]).float().mean().item() for j, lin in enumerate(linears)]
        spread = [lin(x).std() for lin in linears]
        weight = torch.cat([lin.weight / s for lin, s in zip(linears, spread, strict=True)])
        bias = torch.cat([lin.bias / s for lin, s in zip(linears, spread, strict=True)])
    log.info("projector read-outs (kind, colour, size, word, cell) fit at %s", ", ".join(f"{a:.3f}" for a in accuracy))
    return weight, bias


def init_projector(model, image_processor, seed: int, scenes: int = 1024) -> None:
    """Fold the standardisation and the read-outs (module docstring) into the projector's first layer."""
    x, labels = tower_features(model, image_processor, scenes, seed)
    mean, std = x.mean(0), x.std(0).clamp_min(1e-4)  # [H]
    weight, bias = fit_readouts((x - mean) / std, labels)
    linear = model.model.multi_modal_projector.linear_1
    if weight.shape[0] > linear.out_features:
        raise ValueError(f"the projector is {linear.out_features} wide, fewer than the {weight.shape[0]} read-outs")
    with torch.no_grad():
        linear.weight[: len(weight)] = weight
        linear.bias[: len(bias)] = bias
        linear.weight /= std  # W (x - mean) / std + b = (W / std) x + (b - (W / std) mean)
        linear.bias -= linear.weight @ mean
