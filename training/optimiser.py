"""The training optimiser: AdamW, linear warmup then cosine to a floor, one clipped update per step.

One home for the schedule of every training loop in the repository: the DREAM drafter's
(`training.loop`: no floor, gradients clipped at 0.5, its gates and q/k scales in
a faster parameter group) and the demo models' (the target, its vision tower, the tiny drafter: a
floor of 5%, clipped at 1.0).

    optimiser = Optimiser.adamw(model.parameters(), lr=1e-3, steps=1000, weight_decay=0.1, warmup_steps=30)
    for batch in batches:
        curve.append(optimiser.update(loss_of(batch)))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

Group = tuple[Sequence[torch.nn.Parameter], float]  # (parameters, multiple of the learning rate they learn at)


@dataclass
class Optimiser:
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    clip: float

    @classmethod
    def adamw(
        cls,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        steps: int,
        weight_decay: float,
        warmup_steps: int,
        clip: float = 1.0,
        floor: float = 0.05,
        groups: Sequence[Group] | None = None,
    ) -> Optimiser:
        """Betas (0.9, 0.95); the learning rate warms up over `warmup_steps`, then follows a cosine over
        `steps` down to `floor` times `lr`. `params` have their gradients clipped together (norm `clip`,
        in this order); `groups` split them into AdamW parameter groups, each at its multiple of `lr`
        (default: one group, all at `lr`)."""
        params = list(params)
        param_groups = [{"params": list(p), "lr": lr * scale} for p, scale in groups] if groups else [{"params": params}]
        opt = torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate_factor(s, steps, max(1, warmup_steps), floor))
        return cls(params, opt, sched, clip)

    def update(self, loss: torch.Tensor) -> float:
        """One step on `loss`; -> its value."""
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.sched.step()
        return loss.item()


def learning_rate_factor(step: int, steps: int, warmup: int, floor: float) -> float:
    """The multiple of the peak learning rate at `step`: linear warmup, then a cosine to `floor`."""
    return min(1.0, (step + 1) / warmup) * max(floor, 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))
