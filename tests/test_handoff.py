"""The target-to-DREAM feature handoff: the messages a DREAM drafter receives from its target."""

from __future__ import annotations

import torch

from pipespec.engine.handoff import FEATURE_DTYPE, prefill_message, step_message
from pipespec.protocol.messages import PrefillFeatures


def test_the_prefill_message_carries_embeddings_and_hidden_in_bf16_and_the_rest_as_given():
    mask = torch.tensor([False, True, True, False, False])
    pre = PrefillFeatures(torch.randn(5, 4), torch.randn(5, 4), mask, torch.rand(5))
    got = prefill_message("r", pre)
    assert (got.request_id, got.start, got.hidden) == ("r", 0, None)
    assert FEATURE_DTYPE == torch.bfloat16
    assert torch.equal(got.prefill.embeddings, pre.embeddings.to(torch.bfloat16))
    assert torch.equal(got.prefill.hidden, pre.hidden.to(torch.bfloat16))
    assert got.prefill.image_mask is mask and got.prefill.attention_received is pre.attention_received


def test_a_step_message_holds_the_fed_tokens_and_the_accepted_drafts():
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # a forward that fed 2 tokens of its own, then 4 drafts
    got = step_message("r", 7, hidden, fed=2, accepted=3)
    assert (got.request_id, got.start, got.prefill) == ("r", 7, None)
    assert torch.equal(got.hidden, hidden[:5].to(torch.bfloat16))
