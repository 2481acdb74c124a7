"""The first test of everything: the pipeline's output equals the target alone, token for token.

Small Llama models with random weights, saved and loaded from disk through the real loading code
(`tests.fixtures.toy_models`): drafters made of the target's first layers (they agree with it about
half the time, so acceptance and rejection paths both run) and an independent model (agrees almost
never). k = 2, 3, 4 stages; lookahead 0..8; greedy and coupled sampling with several seeds; 20
prompts; reference = the target alone through `LocalPipeline` with one stage, and Hugging Face
`generate` for greedy.

Floating point tolerance: a verifier's logits over a block of tokens can differ in the last bits
from one-token decoding. Everything runs in fp32, and a mismatch is accepted only where the
reference's top-2 score gap at the first differing position is below EPS (a genuine near-tie);
anywhere else it fails.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipespec import LocalPipeline, load_config
from pipespec.choice import scores
from pipespec.params import SamplingParams
from pipespec.stages.causal_lm import CausalLMStage

EPS = 1e-4
CHAINS = {2: ["tiny", "target"], 3: ["tiny", "mid", "target"], 4: ["other", "tiny", "mid", "target"]}
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def loaded(family):
    """Each model loaded once (fp32) and shared by every pipeline of this module."""
    return {name: CausalLMStage(name, path, "float32") for name, path in family.items()}


@pytest.fixture(scope="module")
def prompts(family):
    from tests.fixtures.toy_models import corpus

    tok = AutoTokenizer.from_pretrained(family["target"])
    return [tok.encode(line)[:12] for line in corpus(20, seed=7)]


def pipeline(family, loaded, names, lookahead=4):
    config = load_config(
        {
            "stages": [
                {"name": n, "kind": "causal_lm", "model": family[n], "max_lookahead": lookahead, "dtype": "float32"}
                for n in names
            ]
        }
    )
    return LocalPipeline(config, stages=[loaded[n] for n in names])


@pytest.fixture(scope="module")
def reference(family, loaded):
    with pipeline(family, loaded, ["target"]) as p:
        yield p


@pytest.fixture(scope="module")
def target_model(family):
    return AutoModelForCausalLM.from_pretrained(family["target"], dtype=torch.float32).eval()


def assert_same(got, want, prompt, params, model):
    """Equal token for token, or first differing at a near-tie of the reference (see module doc)."""
    if got == want:
        return
    j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else min(len(got), len(want))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:j]])).logits[0, -1:].float()
    top2 = torch.topk(scores(logits, params, j)[0], 2).values
    gap = float(top2[0] - top2[1])
    assert gap < EPS, f"output differs at position {j} where the reference's top-2 gap is {gap:.3g}: {got} vs {want}"


def sampling_cases():
    return [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=2),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 4])
def test_twenty_prompts_equal_target_alone(k, family, loaded, prompts, reference, target_model):
    with pipeline(family, loaded, CHAINS[k]) as p:
        for params in sampling_cases():
            kw = dict(
                max_new_tokens=NEW_TOKENS,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
            )
            futures = [(q, p.submit(prompt_token_ids=q, **kw), reference.submit(prompt_token_ids=q, **kw)) for q in prompts]
            accepted = 0
            for q, fut, ref in futures:
                got, want = fut.result(), ref.result()
                assert_same(got.token_ids, want.token_ids, q, params, target_model)
                accepted += sum(pair.num_accepted_tokens for pair in got.stats.pairs)
            assert accepted > 0, "no draft was ever accepted: the test would not exercise acceptance"


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 4])
def test_every_lookahead_equals_target_alone(k, family, loaded, prompts, reference, target_model):
    for lookahead in range(9):
        with pipeline(family, loaded, CHAINS[k], lookahead) as p:
            for params in sampling_cases()[:2]:
                kw = dict(max_new_tokens=NEW_TOKENS, temperature=params.temperature, seed=params.seed)
                for q in prompts[:3]:
                    got = p.generate(prompt_token_ids=q, **kw).token_ids
                    assert_same(got, reference.generate(prompt_token_ids=q, **kw).token_ids, q, params, target_model)


def test_target_alone_equals_hugging_face_generate(prompts, reference, target_model):
    for q in prompts:
        ours = reference.generate(prompt_token_ids=q, max_new_tokens=NEW_TOKENS).token_ids
        with torch.no_grad():
            hf = target_model.generate(torch.tensor([q]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(q) :].tolist()
        assert_same(ours, hf, q, SamplingParams(), target_model)


def test_coupled_sampling_is_reproducible_and_seed_dependent(family, loaded, prompts):
    with pipeline(family, loaded, CHAINS[3]) as p:
        a = p.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS, temperature=1.0, seed=5).token_ids
        b = p.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS, temperature=1.0, seed=5).token_ids
        c = p.generate(prompt_token_ids=prompts[0], max_new_tokens=NEW_TOKENS, temperature=1.0, seed=6).token_ids
    assert a == b
    assert a != c
