"""Dense pretraining of the demo target's vision tower, before the target learns to talk about images.

A CLIP-style tower trained from scratch only through a language model's answers learns slowly: on a
2-core CPU, 40 minutes of end-to-end training taught the first demo target to count but not to see
colours or positions. This step plays the part that contrastive pretraining plays for real LLaVA
models, on the world's ground truth instead of captions: every patch predicts what is drawn in the
grid cell under it (the shape's kind, colour and size, the printed word, and which cell it is), and the
class token predicts the background and the number of shapes. Random scenes are drawn fresh for every batch
(rendering takes a quarter of a millisecond), so the tower never sees a scene twice.

Run by `python -m demo.train tower` (into models/demo/tower) before the language model trains over the
frozen tower.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from demo.world import BACKGROUNDS, CELLS, COLOURS, KINDS_OF_SHAPE, SIZES, WORDS, Scene, random_scene, render
from training.optimiser import Optimiser

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heads:
    """The number of classes of each label; index 0 of the per-cell labels means "nothing there"."""

    kind: int = 1 + len(KINDS_OF_SHAPE)
    colour: int = 1 + len(COLOURS)
    size: int = 1 + len(SIZES)
    word: int = 1 + len(WORDS)
    background: int = len(BACKGROUNDS)
    count: int = 5  # 0..4 shapes


def cell_of_patches(grid: int) -> torch.Tensor:
    """[grid * grid] the index into CELLS of the cell under each patch's centre (row-major)."""
    band = [min(2, int((i + 0.5) * 3 / grid)) for i in range(grid)]
    return torch.tensor([3 * band[r] + band[c] for r in range(grid) for c in range(grid)])


def cell_labels(scene: Scene) -> torch.Tensor:
    """[9, 4] per cell: kind, colour, size, word (0 = nothing)."""
    out = torch.zeros(len(CELLS), 4, dtype=torch.long)
    for s in scene.shapes:
        i = CELLS.index(s.cell)
        out[i, :3] = torch.tensor([1 + KINDS_OF_SHAPE.index(s.kind), 1 + list(COLOURS).index(s.colour), 1 + SIZES.index(s.size)])
    if scene.word is not None:
        out[CELLS.index(scene.word.cell), 3] = 1 + WORDS.index(scene.word.text)
    return out


class DenseProbe(nn.Module):
    """Linear heads on the tower's last hidden states: per patch (cell contents) and on the class token."""

    def __init__(self, hidden: int, heads: Heads = Heads()):
        super().__init__()
        self.cell = nn.ModuleList(nn.Linear(hidden, n) for n in (heads.kind, heads.colour, heads.size, heads.word))
        self.where = nn.Linear(hidden, len(CELLS))  # the patch's own cell: keeps "where" linearly readable at the top
        self.background = nn.Linear(hidden, heads.background)
        self.count = nn.Linear(hidden, heads.count)

    def loss(
        self, states: torch.Tensor, cells: torch.Tensor, background: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """states [B, 1 + N, H] (class token first); cells [B, N, 4]; background, count [B] -> (loss, patch accuracy)."""
        patches = states[:, 1:].float()
        loss = sum(F.cross_entropy(head(patches).flatten(0, 1), cells[..., j].flatten()) for j, head in enumerate(self.cell))
        under = cell_of_patches(math.isqrt(patches.shape[1])).repeat(patches.shape[0])  # [B * N]
        loss = loss + F.cross_entropy(self.where(patches).flatten(0, 1), under)
        cls = states[:, 0].float()
        loss = loss + F.cross_entropy(self.background(cls), background) + F.cross_entropy(self.count(cls), count)
        with torch.no_grad():
            right = torch.stack([head(patches).argmax(-1) == cells[..., j] for j, head in enumerate(self.cell)], -1)
        return loss, right.all(-1).float().mean().item()


def scene_batches(image_processor, size: int, patch: int, batch_size: int, seed: int | list[int]):
    """Endless batches of fresh train-split-like scenes: (pixel_values [B, 3, S, S], cells [B, N, 4], background [B], count [B])."""
    rng = np.random.default_rng(seed)
    under = cell_of_patches(size // patch)
    while True:
        scenes = [random_scene(rng) for _ in range(batch_size)]
        pixels = image_processor(images=[render(s, size) for s in scenes], return_tensors="pt")["pixel_values"]
        cells = torch.stack([cell_labels(s)[under] for s in scenes])
        background = torch.tensor([list(BACKGROUNDS).index(s.background) for s in scenes])
        count = torch.tensor([len(s.shapes) for s in scenes])
        yield pixels, cells, background, count


def pretrain_tower(
    tower: nn.Module,
    image_processor,
    size: int,
    patch: int,
    minutes: float,
    steps: int,
    seed: int,
) -> tuple[list[float], DenseProbe]:
    """Train `tower` (a CLIPVisionModel) in place with the dense probe, in fp32 (on a CPU without bf16
    instructions a bf16-autocast step costs 16-23x an fp32 one); -> (the loss curve, the probe)."""
    torch.manual_seed(seed)
    probe = DenseProbe(tower.config.hidden_size)
    optimiser = Optimiser.adamw(
        [*tower.parameters(), *probe.parameters()], 2e-3, steps, weight_decay=0.05, warmup_steps=steps // 20
    )
    data = scene_batches(image_processor, size, patch, 64, seed)
    deadline = time.monotonic() + minutes * 60
    curve: list[float] = []
    tower.train()
    bar = tqdm(range(steps), desc="tower")
    for _ in bar:
        pixels, cells, background, count = next(data)
        states = tower(pixel_values=pixels).last_hidden_state  # [B, 1 + N, H]
        loss, accuracy = probe.loss(states, cells, background, count)
        curve.append(optimiser.update(loss))
        bar.set_postfix(loss=f"{curve[-1]:.3f}", patches_right=f"{accuracy:.2f}")
        if time.monotonic() > deadline:
            log.info("tower: time budget reached after %d steps", len(curve))
            break
    tower.eval()
    return curve, probe
