"""The demo models' optimiser: AdamW, linear warmup then cosine to a floor, one clipped update per step.

Shared by the tower's dense pretraining (`demo.tower`) and the language models'
training (`demo.train`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Optimiser:
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    clip: float

    @classmethod
    def adamw(
        cls,
        params: Sequence[torch.nn.Parameter],
        lr: float,
        steps: int,
        weight_decay: float,
        warmup_steps: int,
        clip: float = 1.0,
    ) -> Optimiser:
        """Betas (0.9, 0.95); the learning rate warms up over `warmup_steps`, then follows a cosine over
        `steps` down to 5% of `lr`."""
        params = list(params)
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
        warmup = max(1, warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
        )
        return cls(params, opt, sched, clip)

    def update(self, loss: torch.Tensor) -> float:
        """One step on `loss`; -> its value."""
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.sched.step()
        return loss.item()
