"""The DREAM loss on one sequence, in two passes. Per answer position:

    loss = 0.2 SmoothL1(f, target last hidden) + 0.2 SmoothL1(block 0 output, RMS-normalised selected layer)
           + 1.0 KL(target || draft), summed over the vocabulary, mean over answer positions

twice: with the target's features as memory, then (the training-time test pass) with the memory at
answer positions replaced by the drafter's own detached features from the first pass, as at
inference; the loss is the mean of the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipespec.stages.dream.compression import kept_positions
from pipespec.stages.dream.model import DreamDrafter
from training.features import SequenceFeatures
from training.variants import Variant


def sequence_loss(
    drafter: DreamDrafter, feats: SequenceFeatures, lm_head: torch.Tensor, variant: Variant
) -> tuple[torch.Tensor, dict[str, float]]:
    """The two-pass DREAM loss on one sequence; -> (loss, its parts)."""
    T, P = feats.ids.shape[0], feats.prompt_len
    keep = torch.ones(T, dtype=torch.bool)
    keep[: P - 1] = kept_positions(feats.image_mask[: P - 1], feats.attention_received, variant.keep_fraction)
    positions = keep.nonzero().squeeze(-1)  # [N]
    inputs = feats.embeddings[positions][None]  # [1, N, H]
    memory = feats.hidden[positions][None]
    answer_rows = (positions >= P - 1) & (positions <= T - 2)  # queries predicting answer tokens
    target_f = feats.hidden[positions][answer_rows]
    # The selected layer's residual stream is ~5-18x the scale of the post-norm last hidden state (RMS 4.6
    # at layer 0 to 17.7 at layer 23 on the demo target): raw, its SmoothL1 sits in the L1 regime and
    # outweighs the KL. RMS-normalised per token, both regressions are on the last hidden state's scale.
    target_a = F.rms_norm(feats.supervision(variant.layer)[positions][answer_rows], (feats.hidden.shape[-1],))
    target_logp = F.log_softmax(feats.logits[positions][answer_rows], dim=-1)

    def one_pass(memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        f, a = drafter(inputs, positions, memory, positions)
        f = f[0][answer_rows]
        logp = F.log_softmax(f @ lm_head.T, dim=-1)
        kl = (target_logp.exp() * (target_logp - logp)).sum(-1).mean()  # summed over the vocabulary
        reg_f = F.smooth_l1_loss(f, target_f)
        reg_a = F.smooth_l1_loss(a[0][answer_rows], target_a) if a is not None else torch.zeros(())  # EAGLE: no intermediate
        loss = 0.2 * reg_f + 0.2 * reg_a + kl
        return loss, f, {"kl": kl.item(), "f": reg_f.item(), "intermediate": reg_a.item()}

    loss1, f1, parts = one_pass(memory)
    own = memory.clone()
    own[0, answer_rows] = f1.detach()  # the test-time pass: our own features where we would be drafting
    loss2, _, _ = one_pass(own)
    return (loss1 + loss2) / 2, parts
