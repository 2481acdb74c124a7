"""The synchronous baseline is a correct speculative decoder too: it equals the target alone."""

from __future__ import annotations

import pytest

from pipespec import LocalPipeline, load_config
from pipespec.engine.synchronous import generate_sync
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.stages.build import load_stages

TARGET = {"name": "t", "kind": "mock", "vocab_size": 50}


@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sync_speculation_equals_target_alone(gamma, temperature):
    drafter, target = load_stages(
        load_config({"stages": [{"name": "d", "kind": "mock", "agreement": 0.7, "vocab_size": 50}, TARGET]})
    )
    with LocalPipeline(load_config({"stages": [TARGET]}), stages=[target]) as alone:
        for seed in range(4):
            spec = RequestSpec(f"r{seed}", (seed + 1, 2, 3), SamplingParams(temperature=temperature, seed=seed), 40)
            got = generate_sync(target, spec, drafter, gamma)
            want = alone.generate(prompt_token_ids=spec.prompt_token_ids, max_new_tokens=40, temperature=temperature, seed=seed)
            assert got.token_ids == want.token_ids
            assert got.pair.num_accepted_tokens > 0 and got.target_forwards < 40
