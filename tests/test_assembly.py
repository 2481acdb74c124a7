"""Tests for pipespec/wiring/assembly.py: the coordinator's side built from the config, and a chain of
runners linked in process (each to its drafter, its verifier and the coordinator). The gRPC links are
exercised end to end in test_transport.py and test_cluster.py."""

from __future__ import annotations

import pytest

from pipespec import load_config
from pipespec.engine.runner import StageRunner
from pipespec.protocol.links import InProcessLink
from pipespec.requests.frontdoor import TargetInfo
from pipespec.requests.generate_args import GenerateArgs
from pipespec.requests.tokenization import IncrementalDetokenizer
from pipespec.stages.build import load_stages
from pipespec.wiring.assembly import Entrance, link_in_process


def mocks(k):
    return load_config({"stages": [{"name": f"m{i}", "kind": "mock", "vocab_size": 32} for i in range(k)]})


def test_mock_stages_have_no_tokenizer():
    entrance = Entrance.check(mocks(2))
    assert (entrance.tokenizer, entrance.processor, entrance.tokenizer_size) == (None, None, None)
    coordinator = entrance.coordinator()
    assert coordinator.stage_names == ["m0", "m1"] and coordinator.detokenizer_factory is None


def test_text_stages_share_the_tokenizer(family):
    config = load_config({"stages": [{"name": n, "kind": "causal_lm", "model": family[n]} for n in ("tiny", "target")]})
    entrance = Entrance.check(config)
    assert entrance.tokenizer_size == len(entrance.tokenizer)
    assert isinstance(entrance.coordinator().detokenizer_factory(), IncrementalDetokenizer)
    target = TargetInfo("target", "causal_lm", 64, None, frozenset())
    spec, stop = entrance.front_door(target).request(GenerateArgs(prompt_token_ids=[1, 2], stop=["."]))
    assert spec.prompt_token_ids == (1, 2) and stop == (".",)


@pytest.mark.parametrize("k", [1, 3])
def test_link_in_process_connects_neighbours_and_coordinator(k):
    config = mocks(k)
    runners = [StageRunner.for_config(stage, config, i) for i, stage in enumerate(load_stages(config))]
    coordinator = Entrance.check(config).coordinator()
    try:
        link_in_process(runners, coordinator)
        for i, runner in enumerate(runners):
            assert runner.coordinator.peer is coordinator
            assert (runner.upstream.peer if runner.upstream else None) is (runners[i - 1] if i else None)
            assert (runner.downstream.peer if runner.downstream else None) is (runners[i + 1] if i < k - 1 else None)
        assert [link.peer for link in coordinator.stages] == runners
    finally:
        for runner in runners:
            runner.scheduler.shutdown(wait=True)


def test_a_runner_keeps_the_links_not_given():
    config = mocks(2)
    drafter, target = [StageRunner.for_config(stage, config, i) for i, stage in enumerate(load_stages(config))]
    coordinator = Entrance.check(config).coordinator()
    try:
        link_in_process([drafter, target], coordinator)
        before, replacement = target.coordinator, InProcessLink(drafter)
        target.connect(upstream=replacement)
        assert target.coordinator is before and target.upstream is replacement and target.downstream is None
    finally:
        for runner in (drafter, target):
            runner.scheduler.shutdown(wait=True)


def test_the_coordinator_needs_a_link_per_stage():
    coordinator = Entrance.check(mocks(2)).coordinator()
    with pytest.raises(ValueError, match="1 links for the 2 stages"):
        coordinator.connect([object()])


def test_the_assembly_is_torch_free_at_import():
    """The coordinator's actor builds its side here: no torch (nor Ray, nor gRPC) at import."""
    from tests.test_coordinator_import import BYPASS_PACKAGE_INIT, REPORT, run_python

    code = BYPASS_PACKAGE_INIT + "import pipespec.wiring.assembly\n" + REPORT + "assert not {'ray', 'grpc'} & set(sys.modules)\n"
    result = run_python(code)
    assert result.returncode == 0, result.stdout + result.stderr
