"""The DREAM ablation grid: seeds summarised per variant, and worker processes giving what one
process gives."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from training.ablation import GridSpec, run_grid, worker_threads
from training.data import examples_for, noise_samples
from training.variants import VARIANTS

pytestmark = pytest.mark.slow

VARIANT = {v.name: v for v in VARIANTS}


@pytest.fixture(scope="module")
def grid_inputs(tmp_path_factory):
    """A zoo target saved to disk (the workers load it from there) and a few short answers."""
    from pipespec.config import StageSpec
    from pipespec.requests.images import load_processor
    from pipespec.stages.vlm import VLMStage
    from tests.fixtures.vlm_zoo import build_zoo_family

    target = str(build_zoo_family("llava", tmp_path_factory.mktemp("ablation"))["target"])
    stage = VLMStage(StageSpec("target", "vlm", target, dtype="float32"))
    examples = examples_for(stage, load_processor(target, "target"), noise_samples("train", 3, 0), 8)
    return stage, examples


def test_each_variant_gets_every_seed_and_their_mean(grid_inputs):
    stage, examples = grid_inputs
    variants = (VARIANT["dream"], VARIANT["no_cross_attention"])
    results = run_grid(stage, variants, examples, examples[:2], GridSpec(steps=4, seeds=(3, 4)))
    assert list(results) == ["dream", "no_cross_attention"]
    for r in results.values():
        assert r["seeds"] == [3, 4] and r["prompts"] == 2 and len(r["per_seed"]) == 2
        assert r["mean_acceptance_length"] == pytest.approx(statistics.fmean(r["per_seed"]))
        assert all(1.0 <= tau <= 6.0 for tau in r["per_seed"])  # at least the target's token, at most gamma + 1
        assert r["per_kind"] == {} and r["per_kind_per_seed"] == {}  # noise samples name no kind


def test_held_out_examples_with_kinds_get_each_kind_s_acceptance_per_seed(grid_inputs):
    import dataclasses

    stage, examples = grid_inputs
    held_out = [dataclasses.replace(ex, group=kind) for ex, kind in zip(examples, ("count", "colour", "colour"))]
    results = run_grid(stage, (VARIANT["dream"],), examples, held_out, GridSpec(steps=4, seeds=(0, 1)))
    r = results["dream"]
    assert list(r["per_kind"]) == ["colour", "count"] and all(len(v) == 2 for v in r["per_kind_per_seed"].values())
    for kind, values in r["per_kind_per_seed"].items():
        assert r["per_kind"][kind] == pytest.approx(statistics.fmean(values))
    for seed, tau in enumerate(r["per_seed"]):  # the whole is a mean over the kinds' rounds: between them
        kinds = [v[seed] for v in r["per_kind_per_seed"].values()]
        assert min(kinds) - 1e-9 <= tau <= max(kinds) + 1e-9


def test_worker_processes_give_what_one_process_gives(grid_inputs):
    stage, examples = grid_inputs
    variants = (VARIANT["dream"], VARIANT["layer_50"])
    spec = GridSpec(steps=6, seeds=(0, 1), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads(2))  # the same kernels, so the same numbers to the last bit
    try:
        here = run_grid(stage, variants, examples, examples, spec)
    finally:
        torch.set_num_threads(threads)
    there = run_grid(stage, variants, examples, examples, spec, jobs=2)
    assert there == here


def test_a_grid_of_no_seeds_is_refused_by_name():
    import subprocess
    import sys

    argv = [sys.executable, "-m", "training.train", "--target", "unused", "--ablations", "--seeds", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2 and "--seeds must be at least 1, got 0" in out.stderr
