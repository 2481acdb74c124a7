"""The processed distribution p' every stage samples from.

`log_processed` turns a stage's raw logits
into log p' (temperature, then top-k, then top-p), the distribution that coupled choices take a
Gumbel-max sample of and that rejection sampling ships downstream as q.
"""

from __future__ import annotations

import torch

from pipespec.params import SamplingParams


def log_processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> log p' [n, V] float64, -inf where top-k / top-p removed a token."""
    x = logits.to(torch.float64) / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keeps the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)
