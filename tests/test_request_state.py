"""The per-request state's small operations: pending drafts consumed and cleared, features taken once."""

from __future__ import annotations

import torch

from pipespec.engine.request_state import FeatureInbox, VerifierSide
from pipespec.protocol.messages import PrefillFeatures, TargetFeatures
from pipespec.protocol.stats import PairStats


def test_pending_drafts_are_dropped_from_the_front_and_cleared_to_a_position():
    up = VerifierSide(PairStats("tiny", "target"), pending=[4, 5, 6], pending_probs=[None, None, None], start=10)
    up.drop_pending(2)
    assert (up.pending, up.pending_probs, up.start) == ([6], [None], 12)
    up.clear_from(15)
    assert (up.pending, up.pending_probs, up.start) == ([], [], 15)


def test_features_are_taken_once_and_the_prefill_is_remembered():
    inbox = FeatureInbox()
    step = TargetFeatures("r", 3, torch.zeros(2, 4))
    inbox.add(step)
    assert not inbox.has_prefill and inbox.take() == (step,) and inbox.take() == ()
    prefill = PrefillFeatures(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, dtype=torch.bool), None)
    inbox.add(TargetFeatures("r", 0, prefill=prefill))
    assert inbox.has_prefill and len(inbox.take()) == 1 and inbox.has_prefill
