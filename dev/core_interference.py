"""Do two "devices" on this machine slow each other down? A stage's forward, alone and beside a busy neighbour.

    python -m dev.core_interference [--config pipespec/configs/demo_two_cores.yaml] [--tokens 48] [--runs 3]

The asynchronous pipeline assumes its devices are independent: a drafter computing on one core does
not slow the target's forward on another. On a shared virtual machine two cores can share caches,
memory bandwidth or one physical core. This measures it: the target alone (`LocalPipeline`, one
torch thread, this process pinned to the second core) decodes a held-out demo question, traced
(pipespec.engine.trace: wall and CPU milliseconds per forward), first with the first core idle, then while
a neighbour process pinned to the first core decodes without pause
(the config's first stage, a text drafter that runs alone: the load it carries in the pipeline). Runs alternate; medians are printed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
from collections.abc import Sequence

from experiments.prompt_sets import load_prompts
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import sub_pipeline

PROMPTS = "experiments/prompts/world_held_out.jsonl"


def _neighbour(config_path: str, core: int, ready, stop) -> None:
    """Decode with the config's first stage (a text drafter: it runs alone) on `core` until `stop`."""
    os.sched_setaffinity(0, [core])
    first = load_config(config_path).stages[0]
    alone = load_config({"stages": [{"name": first.name, "kind": first.kind, "model": first.model, "dtype": first.dtype}]})
    with LocalPipeline(alone) as p:
        p.generate("Describe the image.", max_new_tokens=8)
        ready.set()
        while not stop.is_set():
            p.generate("Describe the image.", max_new_tokens=32)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="pipespec/configs/demo_two_cores.yaml")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    args = parse_logged(parser, argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    config = load_config(args.config)
    drafter = config.stages[0].name
    os.sched_setaffinity(0, [cores[1]])
    prompt = load_prompts(PROMPTS, 1)[0]
    kwargs = {"prompt": prompt.text, "max_new_tokens": args.tokens, **({"image": str(prompt.image)} if prompt.image else {})}
    context = multiprocessing.get_context("spawn")  # not fork: this process already runs torch's threads
    figures: dict[str, list[tuple[float, float]]] = {"idle neighbour": [], f"busy neighbour ({drafter})": []}
    with LocalPipeline(sub_pipeline(config, [config.target.name])) as target:
        target.generate(**kwargs)
        for _ in range(args.runs):
            for label in figures:
                stop, ready = context.Event(), context.Event()
                neighbour = None
                if label != "idle neighbour":
                    neighbour = context.Process(target=_neighbour, args=(args.config, cores[0], ready, stop))
                    neighbour.start()
                    ready.wait()
                target.start_trace()
                target.generate(**kwargs)
                (s,) = target.stop_trace()
                figures[label].append((1e3 * s["compute_s"] / s["steps"], 1e3 * s["compute_on_cpu_s"] / s["steps"]))
                if neighbour is not None:
                    stop.set()
                    neighbour.join()
    print(
        f"target {config.target.name} alone on core {cores[1]}, one torch thread, {args.tokens} tokens, median of {args.runs} runs"
    )
    base = statistics.median(w for w, _ in figures["idle neighbour"])
    for label, runs in figures.items():
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        print(f"  {label:<28} {wall:6.2f} ms per forward ({cpu:6.2f} ms on CPU), {wall / base:.2f}x")


if __name__ == "__main__":
    main()
