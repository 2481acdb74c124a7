"""What a forward costs each model stage, by block size, eager and compiled, beside its weight-streaming floor.

    python -m experiments.verify_cost [--config pipespec/configs/demo_two_cores.yaml] [--blocks 1 2 3 4 5 6 7 8]
                                      [--threads 1] [--repeats 15] [--json FILE]

For each model stage of the config (the target last) and each way of running its forwards (eager,
then compiled: pipespec.stages.forwards),
the median milliseconds of a forward of k tokens after the prefill, on the config's first held-out
prompt (`pipespec.planning.profiling.time_forwards`: the block fed again and again at the same place).
Beside them, the floor: one matrix-vector product over as many weights as one forward of the stage
reads (its layers and LM head), in its dtype, on the same thread(s): what streaming its weights from memory once costs here. A one-token
forward cannot be cheaper than that; what it costs above it is overhead (kernel launches, Python).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from experiments.prompt_sets import load_prompts
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import PipelineConfig
from pipespec.planning.profiling import open_session, time_forwards
from pipespec.schema.kinds import ModelOptions, kind_of

PROMPTS = "experiments/prompts/world_held_out.jsonl"


def with_compile(config: PipelineConfig, compiled: bool) -> PipelineConfig:
    """`config` with every stage that takes ModelOptions (or a kind's subclass of them) compiled or not."""
    stages = tuple(
        replace(s, options=replace(s.options or options(), compile=compiled))
        if (options := kind_of(s).options) is not None and issubclass(options, ModelOptions)
        else s
        for s in config.stages
    )
    return replace(config, stages=stages)


def floor_s(parameters: int, dtype: torch.dtype, repeats: int, device: str = "cpu") -> float:
    """Median seconds of one matrix-vector product over `parameters` weights of `dtype` on `device`
    (rows of 256 on a CPU, as measured so far; of 4096 on a GPU, where short rows do not reach its bandwidth)."""
    columns = 256 if device == "cpu" else 4096
    weights = torch.empty(parameters // columns, columns, dtype=dtype, device=device).normal_()
    x = torch.randn(1, columns, device=device).to(dtype)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        torch.nn.functional.linear(x, weights)[0, 0].item()  # .item(): the device has finished it
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def streamed(stage: object) -> list[torch.Tensor] | None:
    """The weights one decode forward of `stage` reads (its layers and LM head, not the input
    embeddings it only gathers rows of, nor a vision tower); None for a stage without a model."""
    model = getattr(stage, "model", None)
    if model is not None:
        return [*model.get_decoder().layers.parameters(), model.get_output_embeddings().weight]
    drafter = getattr(stage, "drafter", None)
    if drafter is not None:  # a DREAM stage: its blocks and the target's LM head
        return [*drafter.parameters(), stage.lm_head]
    return None


def stage_costs(config: PipelineConfig, blocks: Sequence[int], threads: int, repeats: int) -> dict[str, dict]:
    """-> per stage: its floor and, for eager and compiled, the median seconds per block size."""
    prompt = load_prompts(PROMPTS, 1)[0]
    out: dict[str, dict] = {}
    for how in ("eager", "compiled"):
        with LocalPipeline(with_compile(config, how == "compiled"), torch_threads=threads) as pipe:
            spec, _ = pipe.request(prompt.text, image=str(prompt.image) if prompt.image else None, max_new_tokens=8)
            for stage_spec, stage in zip(config.stages, pipe.stages):
                weights = streamed(stage)
                if weights is None:
                    continue
                entry = out.setdefault(stage_spec.name, {})
                if "floor_s" not in entry:
                    parameters = sum(w.numel() for w in weights)
                    dtype = weights[0].dtype
                    entry.update(parameters=parameters, dtype=str(dtype), floor_s=floor_s(parameters, dtype, repeats))
                reads = kind_of(stage_spec).reads_target_features
                times = []
                for k in blocks:
                    session = open_session(stage, pipe.stages[-1], spec, reads)
                    try:
                        times.append(time_forwards(session, k, repeats)[1])
                    finally:
                        session.close()
                entry[how] = dict(zip(blocks, times))
    return out


def cells(row: dict[int, float], blocks: Sequence[int], floor: float) -> str:
    """A table row's cells: milliseconds per block size, and (x) over the floor."""
    return "".join(f"{1e3 * row[k]:>8.2f} ({row[k] / floor:.1f})" for k in blocks)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="pipespec/configs/demo_two_cores.yaml")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every forward and the floor")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parse_logged(parser, argv)
    costs = stage_costs(load_config(args.config), args.blocks, args.threads, args.repeats)
    print(f"median ms per forward after the prefill, {args.threads} torch thread(s); (x): over the weight-streaming floor")
    print(f"{'stage':>8} {'how':>9} {'floor':>7}" + "".join(f"{k:>14}" for k in args.blocks))
    for name, entry in costs.items():
        floor = entry["floor_s"]
        for how in ("eager", "compiled"):
            print(f"{name:>8} {how:>9} {1e3 * floor:>7.2f}" + cells(entry[how], args.blocks, floor))
    if args.json:
        args.json.write_text(json.dumps(costs, indent=1))


if __name__ == "__main__":
    main()
