"""A trained DREAM drafter's mean acceptance length: greedy chain drafting (`gamma` tokens per round)
against the target's own answers on held-out examples, through the same `DreamSession` the pipeline
runs, fed the target's features as the runner hands them over (bf16); overall and per group of
examples (the kind of question, where the samples name one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipespec.engine.handoff import hidden_message, prefill_message
from pipespec.protocol.messages import PrefillFeatures, RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.stages.dream.checkpoint import DreamCheckpoint
from pipespec.stages.dream.stage import DreamSession, DreamStage
from pipespec.stages.vlm import VLMStage
from training.data import Example
from training.features import FeatureExtractor, SequenceFeatures

ALL = "all"  # the key of the acceptance over every example


def mean_acceptance_length(stage: VLMStage, ckpt: DreamCheckpoint, examples: Sequence[Example], gamma: int = 5) -> float:
    """Greedy chain drafting against the target's answers, through the pipeline's DreamSession."""
    return acceptance_lengths(stage, ckpt, examples, gamma)[ALL]


@torch.no_grad()
def acceptance_lengths(stage: VLMStage, ckpt: DreamCheckpoint, examples: Sequence[Example], gamma: int = 5) -> dict[str, float]:
    """{"all": the mean acceptance length over every drafting round, group: the same over the rounds
    of that group's examples} (groups in sorted order)."""
    dream = DreamStage("dream", ckpt, width=stage.vocab_size, valid=stage.fit.valid)
    gained: dict[str, list[int]] = {}  # tokens each round produced (accepted drafts + the target's own), per group
    with FeatureExtractor(stage) as extractor:
        for ex in examples:
            if ex.answer_ids:
                feats = extractor(list(ex.prompt_ids), list(ex.answer_ids), stage.tensors(ex.image))
                gained.setdefault(ex.group, []).extend(chain_drafting(dream, ex, feats, gamma))
    rounds = [r for group in gained.values() for r in group]
    means = {ALL: sum(rounds) / max(len(rounds), 1)}
    return means | {group: sum(g) / len(g) for group, g in sorted(gained.items()) if group}


def chain_drafting(dream: DreamStage, ex: Example, feats: SequenceFeatures, gamma: int) -> list[int]:
    """Draft `gamma` tokens, check them against the target's answer, hand over the target's features
    of what is now known (bf16, as the runner sends them), repeat; -> tokens gained per round."""
    P, N = len(ex.prompt_ids), len(ex.answer_ids)
    session = dream.open(RequestSpec("eval", ex.prompt_ids, SamplingParams(), N))
    hand_features(session, feats)
    context = list(ex.prompt_ids) + list(ex.answer_ids)
    known_features = P - 1
    k = 0  # answer tokens known (verified)
    rounds = []
    try:
        while k < N:
            last = P - 1 + k  # context index of the last known token
            start = min(max(session.fed, P - 1), last)  # our cache holds the known tokens before this
            feed = context[start : last + 1]
            drafts: list[int] = []
            for _ in range(min(gamma, N - k)):
                token = int(session.forward(start, feed)[-1].argmax())
                drafts.append(token)
                start, feed = start + len(feed), [token]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == ex.answer_ids[k + accepted]:
                accepted += 1
            rounds.append(min(accepted + 1, N - k))
            k += rounds[-1]
            upto = P + k - 1  # features for every known token but the last (the target's own)
            if upto > known_features:
                hand_features(session, feats, (known_features, upto))
                known_features = upto
    finally:
        session.close()
    return rounds


def hand_features(session: DreamSession, feats: SequenceFeatures, span: tuple[int, int] | None = None) -> None:
    """The target's features to the drafter, as the runner sends them (bf16): with no `span` the prefill
    (every prompt position but the last), else the hidden states of context positions span[0]..span[1]-1."""
    if span is None:
        P = feats.prompt_len
        prefill = PrefillFeatures(
            feats.embeddings[: P - 1], feats.hidden[: P - 1], feats.image_mask[: P - 1], feats.attention_received
        )
        session.add_features(prefill_message("eval", prefill))
    else:
        start, end = span
        session.add_features(hidden_message("eval", start, feats.hidden[start:end]))
