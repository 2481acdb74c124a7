"""The first test of everything: the pipeline's output equals the target alone, token for token.

Small Llama models with random weights, saved and loaded from disk through the real loading code
(`tests.fixtures.toy_models`): drafters made of the target's first layers (they agree with it about
half the time, so acceptance and rejection paths both run) and an independent model (agrees almost
never). k = 2, 3, 4 stages; lookahead 0..8; greedy and coupled sampling with several seeds; 20
prompts; reference = the target alone through `LocalPipeline` with one stage, and Hugging Face
`generate` for greedy.

Floating point tolerance: a verifier's logits over a block of tokens can differ in the last bits
from one-token decoding. Everything runs in fp32, and a mismatch is accepted only at a genuine
near-tie of the reference (`tests.fixtures.exactness.assert_same`); anywhere else it fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipespec import LocalPipeline
from pipespec.config import StageSpec
from pipespec.protocol.params import SamplingParams
from pipespec.stages.causal_lm import CausalLMStage
from tests.fixtures.exactness import assert_same, sampling_cases, text_chain, text_pipeline
from tests.fixtures.toy_models import prompt_ids

CHAINS = {2: ["tiny", "target"], 3: ["tiny", "mid", "target"], 4: ["other", "tiny", "mid", "target"]}
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def loaded(family):
    """Each model loaded once (fp32) and shared by every pipeline of this module."""
    return {name: CausalLMStage(StageSpec(name, "causal_lm", path, dtype="float32")) for name, path in family.items()}


@pytest.fixture(scope="module")
def prompts(family):
    return prompt_ids(family["target"], 20, length=12, seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 4])
def test_twenty_prompts_equal_target_alone(k, family, loaded, prompts, alone, target_model):
    with text_pipeline(family, loaded, CHAINS[k]) as p:
        for params in sampling_cases():
            kw = dict(
                max_new_tokens=NEW_TOKENS,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
            )
            futures = [(q, p.submit(prompt_token_ids=q, **kw)) for q in prompts]
            accepted = 0
            for q, future in futures:
                got = future.result()
                assert_same(got.token_ids, alone(q, **kw), q, params, target_model)
                accepted += sum(pair.num_accepted_tokens for pair in got.stats.pairs)
            assert accepted > 0, "no draft was ever accepted: the test would not exercise acceptance"


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 4])
def test_every_lookahead_equals_target_alone(k, family, loaded, prompts, alone, target_model):
    for lookahead in range(9):
        with text_pipeline(family, loaded, CHAINS[k], lookahead) as p:
            for params in sampling_cases()[:2]:
                kw = dict(max_new_tokens=NEW_TOKENS, temperature=params.temperature, seed=params.seed)
                for q in prompts[:2]:
                    got = p.generate(prompt_token_ids=q, **kw).token_ids
                    assert_same(got, alone(q, **kw), q, params, target_model)


@pytest.mark.parametrize("k", [2, 3])
def test_pre_drafting_equals_target_alone(k, family, loaded, prompts, alone, target_model):
    """Every drafter pre-drafts (pipespec.engine.outcome_cache) on real models, a middle stage handing its drafter
    the branch it took in its Verdict: still the target alone's answer."""
    # lookahead 2: the drafters reach their bound often, so they pre-draft hundreds of branches (at 6 the
    # k = 3 chain's first stage pre-drafted twice in 12 requests, and on a loaded machine not at all)
    config = text_chain(family, CHAINS[k], lookahead=2)
    config = replace(config, stages=(*(replace(s, predraft=3) for s in config.stages[:-1]), config.stages[-1]))
    branches = 0
    with LocalPipeline(config, stages=[loaded[n] for n in CHAINS[k]]) as p:
        for params in sampling_cases()[:2]:
            kw = dict(max_new_tokens=NEW_TOKENS, temperature=params.temperature, seed=params.seed)
            futures = [(q, p.submit(prompt_token_ids=q, **kw)) for q in prompts[:6]]
            for q, future in futures:
                got = future.result()
                assert_same(got.token_ids, alone(q, **kw), q, params, target_model)
                branches += sum(s.predraft_forwards for s in got.stats.stages)
    assert branches > 0, "no drafter pre-drafted: the test exercises nothing"


def test_target_alone_equals_hugging_face_generate(prompts, reference, target_model):
    for q in prompts:
        ours = reference.generate(prompt_token_ids=q, max_new_tokens=NEW_TOKENS).token_ids
        with torch.no_grad():
            hf = target_model.generate(torch.tensor([q]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(q) :].tolist()
        assert_same(ours, hf, q, SamplingParams(), target_model)


def test_coupled_sampling_is_reproducible_and_seed_dependent(family, loaded, prompts):
    with text_pipeline(family, loaded, CHAINS[3]) as p:
        a = p.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS, temperature=1.0, seed=5).token_ids
        b = p.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS, temperature=1.0, seed=5).token_ids
        c = p.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS, temperature=1.0, seed=6).token_ids
    assert a == b
    assert a != c
