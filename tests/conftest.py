"""Shared fixtures, saved to disk once per test session: a family of small random Llama models, and a
small random LLaVA family with an untrained DREAM drafter for its target; and a Ray head for commands to join.

Per test module, over the toy Llamas that the module loads itself (its `loaded` fixture: stage name ->
stage, the target among them): the target alone as a pipeline (`reference`; `alone`: its answers, each
computed once) and as a Hugging Face model (`target_model`), both on `toy_device` ("cpu"; a module overrides it to run them elsewhere)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # as every command's default level sets it: no "Got goaway" among the dots
# Eager forwards unless a test asks for compiled ones (compile: true): compiling costs seconds per model.
os.environ.setdefault("PIPESPEC_COMPILE", "0")

# `make test`'s two workers (tests/xdist_scheduling.py), where xdist is installed
pytest_plugins = ["tests.xdist_scheduling"] if importlib.util.find_spec("xdist") is not None else []

if importlib.util.find_spec("ray") is None:  # e.g. the GPU machine: the modules that need Ray are left out, not errors
    _NEEDS_RAY = re.compile(r"^\s*(import ray|from ray|from pipespec\.cluster|import pipespec\.cluster)", re.M)
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if _NEEDS_RAY.search(p.read_text())]


@pytest.fixture(scope="session")
def family(tmp_path_factory) -> dict:
    """target (8 layers), mid (its first 4), tiny (its first 1), other (independent): paths."""
    from tests.fixtures.toy_models import build_family

    return {name: str(path) for name, path in build_family(tmp_path_factory.mktemp("toy")).items()}


@pytest.fixture(scope="module")
def toy_device() -> str:
    """Where `reference` and `target_model` run; tests/test_gpu.py overrides it with "cuda"."""
    return "cpu"


@pytest.fixture(scope="module")
def reference(family, loaded, toy_device):
    """The target alone: a 1-stage `LocalPipeline` over the module's already-loaded target (`loaded["target"]`)."""
    from tests.fixtures.exactness import text_pipeline

    with text_pipeline(family, loaded, ["target"], device=toy_device) as p:
        yield p


@pytest.fixture(scope="module")
def alone(reference):
    """alone(prompt_token_ids, **sampling) -> the target alone's token ids, each computed once per module: the
    target alone answers a (prompt, sampling) the same whatever chain its answer is compared with."""
    answers: dict = {}

    def ids(prompt_token_ids, **kwargs) -> list[int]:
        key = (tuple(prompt_token_ids), tuple(sorted(kwargs.items())))
        if key not in answers:
            answers[key] = reference.generate(prompt_token_ids=list(prompt_token_ids), **kwargs).token_ids
        return answers[key]

    return ids


@pytest.fixture(scope="module")
def target_model(family, toy_device):
    """The toy target as a Hugging Face model (fp32, eval mode), for references outside the pipeline."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(family["target"], dtype=torch.float32).to(toy_device).eval()


@pytest.fixture(scope="session")
def llava_dream_zoo(tmp_path_factory) -> dict[str, str]:
    """A small random LLaVA family (target, mid, tiny) and an untrained DREAM drafter for its target (dream): paths."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from pipespec.stages.dream.checkpoint import init_from_target, save
    from tests.fixtures.vlm_zoo import build_zoo_family

    root = tmp_path_factory.mktemp("llava-dream-zoo")
    paths = {k: str(v) for k, v in build_zoo_family("llava", root / "llava").items()}
    ckpt = init_from_target(AutoModelForImageTextToText.from_pretrained(paths["target"]), keep_fraction=0.75)
    paths["dream"] = str(save(root / "dream", ckpt, AutoTokenizer.from_pretrained(paths["target"])))
    return paths


@pytest.fixture(scope="session")
def ray_head():
    """A Ray head (3 CPUs: the demo's three stages) that the commands tests run join (`RayHead.join()`), rather than
    each starting a Ray of its own (tests/fixtures/ray_head.py); started once, by the first test that asks."""
    from tests.fixtures.ray_head import ray_head

    with ray_head(num_cpus=3) as head:
        yield head


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker (`make test`), torch in this process gets the worker's share of the cores: two workers
    with a thread per core each would run four threads on two cores, and torch's threads spin while they wait.
    (The processes a test starts, Ray actors and commands, set their own.)"""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `keywords`: a test id holding "gpu" is no marker
            item.add_marker(skip)
