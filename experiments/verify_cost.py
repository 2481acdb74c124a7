"""What a verification costs the target, by block size and torch threads: the ceiling of asynchrony here.

    python -m experiments.verify_cost [--config pipespec/configs/demo_two_cores.yaml] [--blocks 1 2 3 4 5 6 8] [--threads 1 2]

Synchronous speculation gives the target every core while it verifies; the asynchronous pipeline
gives it its own device (here one core) and the drafters the rest. Asynchrony takes the drafting off
the target's critical path, but each verification then runs on fewer threads. On a device where a
block of k tokens costs about as much as one (a GPU, bf16 on some CPUs) that is a clear gain; where
it costs more with k and with fewer threads, it can be none. This prints the target's median
forward seconds for each block size at each thread count on the config's first held-out prompt
(`pipespec.planning.profiling.time_forwards`: after the prefill, the block fed again and again at the same
place), and the ratio to one token at that thread count.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from experiments.prompt_sets import load_prompts
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import add_log_level, setup_logging
from pipespec.config import sub_pipeline
from pipespec.planning.profiling import time_forwards

PROMPTS = "experiments/prompts/world_held_out.jsonl"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="pipespec/configs/demo_two_cores.yaml")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    add_log_level(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    config = load_config(args.config)
    prompt = load_prompts(PROMPTS, 1)[0]
    with LocalPipeline(sub_pipeline(config, [config.target.name]), torch_threads=None) as pipe:
        spec, _ = pipe.request(prompt.text, image=str(prompt.image) if prompt.image else None, max_new_tokens=8)
        target = pipe.stages[-1]
        print(f"target {config.target.name}: median ms per forward after the prefill, by block size")
        print(f"{'threads':>8}" + "".join(f"{k:>14}" for k in args.blocks))
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = []
            for k in args.blocks:
                session = target.open(spec)
                try:
                    times.append(time_forwards(session, k, args.repeats)[1])
                finally:
                    session.close()
            print(f"{threads:>8}" + "".join(f"{1e3 * t:>8.2f} ({t / times[0]:.2f})" for t in times))


if __name__ == "__main__":
    main()
