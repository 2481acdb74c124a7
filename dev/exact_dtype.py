"""Is the pipeline's answer the target alone's, token for token, in a given dtype?

    python -m dev.exact_dtype [--config pipespec/configs/demo_two_cores.yaml] [--dtype bfloat16]
                                      [--prompts 24] [--max-new-tokens 64] [--backend local|ray]

Every model stage of the config is loaded in `--dtype`; for each chain (the drafters before the
target: tiny -> target, tiny -> dream -> target, ...) and each sampling mode (greedy; temperature 0.8
with a seed per prompt), every held-out question is answered by the chain and by pipespec's target
alone: the target alone in one process (`LocalPipeline`), the chains there too (`--backend local`, one
torch thread per stage's compute thread) or on a local Ray (`--backend ray`: an actor per device, gRPC
links, answers through the `Client`). Prints the identical answers per chain and mode. Compiled or
eager as the stages' options say (PIPESPEC_COMPILE).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace

from experiments.prompt_sets import load_prompts
from pipespec import Client, LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import PipelineConfig, sub_pipeline
from pipespec.schema.kinds import kind_of

PROMPTS = "experiments/prompts/world_held_out.jsonl"
MODES = {"greedy": {"temperature": 0.0}, "seeded t=0.8": {"temperature": 0.8}}


def in_dtype(config: PipelineConfig, dtype: str) -> PipelineConfig:
    return replace(config, stages=tuple(replace(s, dtype=dtype) if kind_of(s).loads_model else s for s in config.stages))


def chains(config: PipelineConfig) -> list[list[str]]:
    """Every chain of the config's stages that ends at its target and has at least one drafter."""
    names = [s.name for s in config.stages]
    out = []
    for first in range(len(names) - 1):
        for chain in ([names[first], names[-1]], names[first:]):
            if chain not in out:
                try:
                    sub_pipeline(config, chain)
                except ValueError:  # a ConfigError: a DREAM drafter must sit right before the target
                    continue
                out.append(chain)
    return out


@contextmanager
def running(config: PipelineConfig, backend: str) -> Iterator[LocalPipeline | Client]:
    """`config` served in this process, or on the local Ray (already started) with a `Client` to it."""
    if backend == "local":
        with LocalPipeline(config) as pipe:
            yield pipe
        return
    from pipespec.cluster.pipeline import start_pipeline

    pipeline = start_pipeline(config, port=0)
    try:
        with Client(pipeline.address) as client:
            yield client
    finally:
        pipeline.stop()


def answers(pipe: LocalPipeline | Client, prompts: Sequence, mode: dict, max_new_tokens: int) -> list[tuple[int, ...]]:
    out = []
    for i, p in enumerate(prompts):
        image = str(p.image) if p.image else None
        out.append(tuple(pipe.generate(p.text, image=image, max_new_tokens=max_new_tokens, seed=i, **mode).token_ids))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="pipespec/configs/demo_two_cores.yaml")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--backend", choices=["local", "ray"], default="local", help="where the chains run")
    args = parse_logged(parser, argv)
    config = in_dtype(load_config(args.config), args.dtype)
    prompts = load_prompts(PROMPTS, args.prompts)
    with LocalPipeline(sub_pipeline(config, [config.target.name])) as alone:
        reference = {name: answers(alone, prompts, mode, args.max_new_tokens) for name, mode in MODES.items()}
    print(f"{args.dtype}, {args.backend}: answers identical to pipespec's target alone ({len(prompts)} held-out questions)")
    if args.backend == "ray":
        from pipespec.cluster.pipeline import local_ray
    with local_ray() if args.backend == "ray" else nullcontext():
        for chain in chains(config):
            with running(sub_pipeline(config, chain), args.backend) as pipe:
                for name, mode in MODES.items():
                    got = answers(pipe, prompts, mode, args.max_new_tokens)
                    same = sum(a == b for a, b in zip(got, reference[name]))
                    print(f"  {' -> '.join(chain):<24} {name:<14} {same}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
