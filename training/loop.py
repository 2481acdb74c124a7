"""Training a fresh DREAM drafter on a target's examples: one sequence per step, its features computed
online (`features`), the two-pass loss (`loss`), AdamW with warmup then cosine (`optimiser`, no floor,
gradients clipped at 0.5), the cross-attention's gates and q/k scales learning GATE_LR_SCALE times
faster. A progress bar shows the loss.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from pipespec.stages.dream.checkpoint import DreamCheckpoint, init_from_target
from pipespec.stages.dream.model import DreamDrafter
from pipespec.stages.vlm import VLMStage
from training.data import Example
from training.features import FeatureExtractor
from training.loss import sequence_loss
from training.optimiser import Optimiser
from training.variants import Variant

GATE_LR_SCALE = 30.0
FAST_PARAMETERS = ("_gate", "recency", "q_norm.weight", "k_norm.weight")  # learn GATE_LR_SCALE x faster


def train(
    stage: VLMStage,
    examples: Sequence[Example],
    variant: Variant,
    steps: int,
    lr: float = 3e-4,
    seed: int = 0,
    progress: bool = True,
) -> tuple[DreamCheckpoint, list[float]]:
    """Train a fresh drafter on `examples` (one sequence per step, cycled); -> (checkpoint, loss curve)."""
    ckpt = init_from_target(stage.model, num_heads=_heads(stage), keep_fraction=variant.keep_fraction, seed=seed)
    if not variant.cross_attention:
        torch.manual_seed(seed)
        ckpt.drafter = DreamDrafter(replace(ckpt.drafter.config, cross_attention=False))
    drafter = ckpt.drafter.train()
    head = ckpt.lm_head
    # The cross-attention's tanh gates start at 0 (Mllama-style), its recency slopes are single scalars,
    # and its q/k norm scales cap every attention logit at about sqrt(head_dim) (8 here: too flat to pick
    # one entry out of ~600 image features). At the blocks' learning rate these barely move in a short
    # run (gates ~0.2 after 2000 steps, q/k scales +3% after 4000), so they learn GATE_LR_SCALE times faster.
    fast = [p for n, p in drafter.named_parameters() if n.endswith(FAST_PARAMETERS)]
    rest = [p for n, p in drafter.named_parameters() if not n.endswith(FAST_PARAMETERS)]
    groups = [(rest, 1.0), (fast, GATE_LR_SCALE)]
    optimiser = Optimiser.adamw(
        drafter.parameters(), lr, steps, weight_decay=0.0, warmup_steps=steps // 20, clip=0.5, floor=0.0, groups=groups
    )
    rng = random.Random(seed)
    order: list[int] = []
    curve: list[float] = []
    bar = tqdm(range(steps), desc=f"dream[{variant.name}]", disable=not progress)
    with FeatureExtractor(stage) as extractor:
        for _ in bar:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            ex = examples[order.pop()]
            feats = extractor(list(ex.prompt_ids), list(ex.answer_ids), stage.tensors(ex.image))
            loss, parts = sequence_loss(drafter, feats, head, variant)
            curve.append(optimiser.update(loss))
            bar.set_postfix(loss=f"{np.mean(curve[-20:]):.3f}", kl=f"{parts['kl']:.3f}")
    drafter.eval()
    ckpt.meta = {"variant": variant.name, "supervision_layer": variant.layer or "entropy", "steps": steps, "lr": lr}
    return ckpt, curve


def _heads(stage: VLMStage) -> int:
    return getattr(stage.model.config.get_text_config(), "num_attention_heads", 4)
