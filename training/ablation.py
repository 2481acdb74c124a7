"""The DREAM ablation grid: each variant trained with one or more seeds and evaluated on the same
held-out prompts, in this process or in worker processes, summarised per variant.

One training run's mean acceptance length moves by several percent with the seed alone (the order
the samples come in, the drafter's initialisation): on the demo target the EAGLE-style block gave
3.67 with seed 0 and 3.82 with seed 1. Gaps between variants smaller than that mean nothing from one
seed, so the grid trains each variant with every seed given and reports the mean, each seed's
figure beside it.

The models are small, and on a CPU two processes with one thread each train about 1.5x faster than
one process with two threads, so `jobs` worker processes split the cores between them. Each worker
loads the target once and reads the examples the parent generated from one file.

    results = run_grid(stage, variants, train_set, held_out, GridSpec(steps=4000, seeds=(0, 1)), jobs=2)
    # {"dream": {"mean_acceptance_length": 3.86, "prompts": 48, "per_seed": [3.90, 3.82], "seeds": [0, 1],
    #            "per_kind": {"colour": 4.1, ...}, "per_kind_per_seed": {"colour": [4.2, 4.0], ...}}, ...}

Per kind: where the held-out examples carry a group (the kind of question), each cell's acceptance
over that group's drafting rounds too, so the variants can be compared question kind by question kind.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from pipespec.config import StageSpec
from pipespec.stages.vlm import VLMStage
from training.data import Example
from training.evaluation import ALL, acceptance_lengths
from training.loop import train
from training.variants import Variant


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """How every cell of the grid is trained and evaluated."""

    steps: int
    seeds: tuple[int, ...] = (0,)
    lr: float = 3e-4
    gamma: int = 5  # draft length per round in the evaluation


def run_grid(
    stage: VLMStage,
    variants: Sequence[Variant],
    train_set: Sequence[Example],
    held_out: Sequence[Example],
    spec: GridSpec,
    jobs: int = 1,
) -> dict[str, dict]:
    """Train and evaluate every (variant, seed); -> {variant name: {"mean_acceptance_length", "prompts",
    "per_seed", "seeds", "per_kind", "per_kind_per_seed"}}, in the order of `variants`. `jobs` > 1 runs the cells in that many worker
    processes (spawned, each loading the target from the directory `stage`'s model came from)."""
    cells = [(v, seed) for v in variants for seed in spec.seeds]
    if jobs <= 1:
        taus = [_train_and_evaluate(stage, train_set, held_out, v, seed, spec, progress=True) for v, seed in cells]
    else:
        taus = _in_workers(stage, cells, train_set, held_out, spec, jobs)
    n = len(spec.seeds)
    results = {}
    for i, v in enumerate(variants):
        seeds = taus[i * n : (i + 1) * n]  # cells run variant-major: this variant's seeds in order
        per_kind = {kind: [tau[kind] for tau in seeds] for kind in seeds[0] if kind != ALL}
        results[v.name] = {
            "mean_acceptance_length": statistics.fmean(tau[ALL] for tau in seeds),
            "prompts": len(held_out),
            "per_seed": [tau[ALL] for tau in seeds],
            "seeds": list(spec.seeds),
            "per_kind": {kind: statistics.fmean(values) for kind, values in per_kind.items()},
            "per_kind_per_seed": per_kind,
        }
    return results


def worker_threads(jobs: int) -> int:
    """Torch threads per worker: the cores this process may use, split between `jobs` workers."""
    return max(1, len(os.sched_getaffinity(0)) // jobs)


def _train_and_evaluate(
    stage: VLMStage,
    train_set: Sequence[Example],
    held_out: Sequence[Example],
    variant: Variant,
    seed: int,
    spec: GridSpec,
    progress: bool,
) -> dict[str, float]:
    ckpt, _ = train(stage, train_set, variant, spec.steps, spec.lr, seed, progress=progress)
    return acceptance_lengths(stage, ckpt, held_out, spec.gamma)


def _in_workers(
    stage: VLMStage,
    cells: list[tuple[Variant, int]],
    train_set: Sequence[Example],
    held_out: Sequence[Example],
    spec: GridSpec,
    jobs: int,
) -> list[dict[str, float]]:
    threads = worker_threads(jobs)
    with tempfile.TemporaryDirectory(prefix="dream-ablation-") as tmp:
        examples = Path(tmp) / "examples.pt"
        torch.save({"train": list(train_set), "held_out": list(held_out)}, examples)
        context = multiprocessing.get_context("spawn")  # no forked torch thread pools
        init = (stage.model.name_or_path, str(examples), threads)
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_load_worker, initargs=init) as pool:
            futures = [pool.submit(_worker_cell, v, seed, spec) for v, seed in cells]
            names = {f: f"{v.name} seed {seed}" for f, (v, seed) in zip(futures, cells)}
            bar = tqdm(total=len(futures), desc=f"ablation ({jobs} jobs)")
            for done in concurrent.futures.as_completed(futures):
                bar.set_postfix_str(f"{names[done]}: {done.result()[ALL]:.3f}")
                bar.update()
            bar.close()
            return [f.result() for f in futures]


_worker: dict = {}  # in a worker process: the target stage and the examples, loaded once


def _load_worker(target: str, examples: str, threads: int) -> None:
    torch.set_num_threads(threads)
    _worker["stage"] = VLMStage(StageSpec("target", "vlm", target, dtype="float32"))
    _worker.update(torch.load(examples, weights_only=False))


def _worker_cell(variant: Variant, seed: int, spec: GridSpec) -> dict[str, float]:
    stage, train_set, held_out = _worker["stage"], _worker["train"], _worker["held_out"]
    return _train_and_evaluate(stage, train_set, held_out, variant, seed, spec, progress=False)
