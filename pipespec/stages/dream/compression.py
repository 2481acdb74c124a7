"""Visual token compression: which image positions the DREAM drafter keeps.

Image tokens are ranked by the attention they receive in the target's last layer at prefill, and the
top `keep_fraction` of them are kept, in the drafter's inputs and in its memory alike (the released
DREAM code pruned inputs but not the memory or the loss mask). Text positions are always kept.
Positions are never renumbered: a kept entry keeps its original position. The same functions serve
the `vlm` stage at prefill and DREAM training, so both rank image tokens alike.
"""

from __future__ import annotations

import math

import torch


def attention_received(weights: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
    """[heads, P, P] last-layer attention at prefill -> [P] what each position received.

    Averaged over heads and over the queries after the last image token (the text reading the
    image), so every image token is judged by the same queries; a causal sum over all queries
    would favour early positions, which more queries can see.
    """
    rows = weights.float().mean(0)  # [P, P]
    image = image_mask.nonzero()
    after = int(image[-1]) + 1 if len(image) else 0
    queries = rows[after:] if after < rows.shape[0] else rows
    return queries.mean(0)


def kept_positions(image_mask: torch.Tensor, attention: torch.Tensor | None, keep_fraction: float) -> torch.Tensor:
    """image_mask [P] bool, attention [P] (or None: keep all) -> [P] bool, True where kept."""
    keep = torch.ones_like(image_mask, dtype=torch.bool)
    n_image = int(image_mask.sum())
    if attention is None or keep_fraction >= 1.0 or n_image == 0:
        return keep
    n_keep = math.ceil(keep_fraction * n_image)
    image_positions = image_mask.nonzero().squeeze(-1)  # [n_image]
    order = attention.to(image_mask.device)[image_positions].float().argsort(descending=True, stable=True)
    keep[image_positions[order[n_keep:]]] = False
    return keep
