"""A stage's device: `cpu`, `cuda` (the current CUDA device, under Ray the actor's GPU) or `cuda:N`,
resolved when the stage is built; a GPU this process cannot use is a ConfigError naming the stage.

CUDA's presence is faked where a test needs it, so these run on any machine; the test that uses a
real GPU is marked `gpu`.
"""

from __future__ import annotations

import pytest
import torch

from pipespec import ConfigError, LocalPipeline, load_config
from pipespec.stages.build import build_stage
from pipespec.stages.device import stage_device
from tests.fixtures.exactness import vlm_chain


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """This process sees two GPUs, the current one cuda:1 (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_cpu_is_the_cpu(no_cuda):
    assert stage_device("tiny", "cpu") == torch.device("cpu")


def test_cuda_is_the_current_device(two_gpus):
    assert stage_device("tiny", "cuda") == torch.device("cuda", 1)
    assert stage_device("tiny", "cuda:0") == torch.device("cuda", 0)


def test_a_gpu_this_process_lacks_is_named(two_gpus):
    with pytest.raises(ConfigError, match=r"stage 'target': device 'cuda:2' does not exist; this process sees 2 GPU\(s\)"):
        stage_device("target", "cuda:2")


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_named(no_cuda, device):
    with pytest.raises(ConfigError, match=rf"stage 'target': device '{device}' needs a GPU, but"):
        stage_device("target", device)


def on_cuda(family, names):
    stages = [{"name": n, "kind": "causal_lm", "model": family[n], "dtype": "float32", "device": "cuda"} for n in names]
    return load_config({"stages": stages})


def test_a_text_stage_on_a_missing_gpu_fails_before_its_weights_load(family, no_cuda, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match="stage 'target': device 'cuda' needs a GPU"):
        LocalPipeline(on_cuda(family, ["tiny", "target"]))


def test_every_model_kind_asks_for_its_device(llava_dream_zoo, no_cuda):
    """vlm, dream and causal_lm stages built from a config on `cuda` all refuse a machine without one."""
    config = vlm_chain(llava_dream_zoo, ["tiny", "dream", "target"], device="cuda")
    for i, spec in enumerate(config.stages):
        with pytest.raises(ConfigError, match=rf"stage '{spec.name}': device 'cuda' needs a GPU"):
            build_stage(spec, config.stages[i:], 100, None, config.sends_features(i))


@pytest.mark.gpu
def test_cuda_resolves_to_the_current_gpu():
    assert stage_device("tiny", "cuda") == torch.device("cuda", torch.cuda.current_device())
