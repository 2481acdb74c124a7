"""The target-to-DREAM feature handoff: what a target hands the DREAM drafter right before it, and when.

A DREAM drafter (pipespec.stages.dream) cross-attends to its target's features. Its sessions are
`FeatureReader`s, the target's `FeatureSource`s (pipespec.engine.stage), and the features travel as
`TargetFeatures` messages in `FEATURE_DTYPE` (bf16: half the bytes, framed exactly):

- once per request, after the target's prefill, the prompt's features (`prefill_message`): merged
  input embeddings, last-layer hidden states, image mask and image attention;
- after each verification step, before its verdict, the hidden states of what the target now holds
  as true (`step_message`): the tokens of its own it fed, then the drafts it accepted.

The pipeline's runner, the synchronous baseline, `pipespec plan` and DREAM training all build their
messages here. `FeaturedVerifier` pairs a DREAM stage with its target outside a pipeline, so that the
DREAM stage can verify a drafter on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pipespec.engine.stage import FeatureReader, FeatureSource, Stage
from pipespec.protocol.messages import PrefillFeatures, RequestSpec, TargetFeatures

FEATURE_DTYPE = torch.bfloat16  # target features travel to a DREAM drafter in bf16 (half the bytes, framed exactly)


def prefill_message(request_id: str, prefill: PrefillFeatures) -> TargetFeatures:
    """The target's prefill features as its DREAM drafter receives them (embeddings and hidden in bf16)."""
    sent = replace(prefill, embeddings=prefill.embeddings.to(FEATURE_DTYPE), hidden=prefill.hidden.to(FEATURE_DTYPE))
    return TargetFeatures(request_id, 0, prefill=sent)


def hidden_message(request_id: str, start: int, hidden: torch.Tensor) -> TargetFeatures:
    """hidden [n, H]: the target's hidden states of context positions start.., as its DREAM drafter receives them."""
    return TargetFeatures(request_id, start, hidden.to(FEATURE_DTYPE))


def step_message(request_id: str, start: int, hidden: torch.Tensor, fed: int, accepted: int) -> TargetFeatures:
    """After a verification step: its forward fed, from context position `start`, `fed` of the target's own
    tokens then the drafts, and `accepted` drafts were accepted. hidden [fed + drafts, H] is the forward's;
    the message holds its first fed + accepted rows."""
    return hidden_message(request_id, start, hidden[: fed + accepted])


def hand_prefill(reader: FeatureReader, source: FeatureSource, request_id: str) -> None:
    """Outside a pipeline: give a DREAM session its target session's prefill features, as a pipeline ships them."""
    reader.add_features(prefill_message(request_id, source.prefill_features))


class FeaturedVerifier:
    """A DREAM stage verifying an upstream drafter outside a pipeline: the target runs beside it and,
    before each forward, hands it the prefill features and its hidden states of every context position
    the DREAM stage already holds, as if the target had verified up to the drafts. In a pipeline the
    target lags a little, so this is the DREAM stage at its best-informed."""

    def __init__(self, dream: Stage, target: Stage):
        self.dream = dream
        self.target = target
        self.name = dream.name
        self.vocab_size = dream.vocab_size

    def open(self, request: RequestSpec) -> FeaturedSession:
        target = self.target.open(request)
        dream = self.dream.open(request)
        hand_prefill(dream, target, request.request_id)
        return FeaturedSession(dream, target, request)


class FeaturedSession:
    """A `FeaturedVerifier`'s session: the DREAM session, and the target's kept fed up to what it holds."""

    def __init__(self, dream: FeatureReader, target: FeatureSource, request: RequestSpec):
        self.dream = dream
        self.target = target
        self.request_id = request.request_id
        self.prompt_len = dream.prompt_len
        self.last_prompt_token = dream.last_prompt_token
        self.context = list(request.prompt_token_ids)  # the context both sessions see, up to what was fed
        self.target_fed = target.prompt_len - 1

    def forward(self, keep: int, tokens: Sequence[int]) -> torch.Tensor:
        self.target_fed = min(self.target_fed, keep)
        if self.target_fed < keep:
            self.target.forward(self.target_fed, self.context[self.target_fed : keep])
            self.dream.add_features(hidden_message(self.request_id, self.target_fed, self.target.hidden))
            self.target_fed = keep
        self.context[keep:] = tokens
        return self.dream.forward(keep, tokens)

    def close(self) -> None:
        self.dream.close()
        self.target.close()
