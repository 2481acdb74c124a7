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


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from tests.test_forwards import _llama

    return _llama(tmp_path_factory.mktemp("llama"), 256, 2)


def _llama_stage(path: str, name: str, dtype: str):
    from pipespec.config import StageSpec
    from pipespec.schema.kinds import ModelOptions
    from pipespec.stages.causal_lm import CausalLMStage

    return CausalLMStage(StageSpec(name, "causal_lm", path, dtype=dtype, options=ModelOptions(compile=False, max_width=16)))


@pytest.mark.parametrize("shape", [(7, 7, 2), (3, 2, 3), (15, 4, 4)], ids=lambda s: "budget{}-depth{}-branching{}".format(*s))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sync_trees_equal_target_alone(llama, shape, temperature):
    """A drafter (the target's model in bf16: it agrees often, not always) grows trees; the target verifies each in
    one tree forward and keeps its accepted path's cache: its answer is its own, token for token."""
    from pipespec.protocol.tree_shape import TreeShape

    target, drafter = _llama_stage(llama, "t", "float32"), _llama_stage(llama, "d", "bfloat16")
    accepted = 0
    for seed in range(3):
        spec = RequestSpec(f"r{seed}", (seed + 5, 20, 30, 40), SamplingParams(temperature=temperature, seed=seed), 24)
        want = generate_sync(target, spec).token_ids
        got = generate_sync(target, spec, drafter, tree=TreeShape(*shape))
        assert got.token_ids == want
        accepted += got.pair.num_accepted_tokens
    assert accepted > 0


def test_sync_trees_under_rejection_sampling_run_to_the_end(llama):
    from pipespec.engine.tree_verification import TreeVerify
    from pipespec.protocol.params import VerifyMode
    from pipespec.protocol.tree_shape import TreeShape

    target, drafter = _llama_stage(llama, "t", "float32"), _llama_stage(llama, "d", "bfloat16")
    params = SamplingParams(temperature=0.9, seed=1, verify=VerifyMode.REJECTION)
    for method in TreeVerify:
        got = generate_sync(target, RequestSpec("r", (5, 20, 30), params, 24), drafter, tree=TreeShape(7, 4, 2), method=method)
        assert len(got.token_ids) == 24 and got.pair.num_draft_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sync_trees_of_mocks_equal_target_alone(temperature):
    """The mocks' world (a drafter that agrees 70% of the time, the target's token its runner-up half of the rest):
    trees over their tree forwards, the target's answer."""
    from pipespec.protocol.tree_shape import TreeShape

    drafter, target = load_stages(
        load_config({"stages": [{"name": "d", "kind": "mock", "agreement": 0.7, "runner_up": 0.5, "vocab_size": 50}, TARGET]})
    )
    for seed in range(4):
        spec = RequestSpec(f"r{seed}", (seed + 1, 2, 3), SamplingParams(temperature=temperature, seed=seed), 40)
        got = generate_sync(target, spec, drafter, tree=TreeShape(budget=7, depth=5, branching=2))
        assert got.token_ids == generate_sync(target, spec).token_ids
        assert got.pair.num_accepted_tokens > 0


def test_a_tree_needs_a_target_with_tree_forwards():
    from pipespec.protocol.tree_shape import TreeShape

    class Chains:  # a stage whose sessions feed lines only
        name, vocab_size = "chains", 50

        def open(self, request):
            session = target.open(request)
            return type("Lines", (), {"prompt_len": session.prompt_len, "last_prompt_token": session.last_prompt_token,
                                      "forward": session.forward, "close": session.close})()  # fmt: skip

    drafter, target = load_stages(load_config({"stages": [{"name": "d", "kind": "mock", "vocab_size": 50}, TARGET]}))
    with pytest.raises(ValueError, match="draft trees need a target with tree forwards, which Lines lacks"):
        generate_sync(Chains(), RequestSpec("r", (1, 2, 3), SamplingParams(), 8), drafter, tree=TreeShape())
