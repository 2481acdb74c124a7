"""Which drafters of an emulated chain should pre-draft: none, the first, the last (next to the target), or all.

    python -m experiments.predraft_placement [--depth 3] [--time-scale 0.1] [--rounds 4] [--predraft 8] [--tokens 64]

The chain is the last `--depth` models of experiments.scaling's CHAIN (mock stages, in this process, tree
forwards: pipespec.engine.stage.TreeSession). Each side runs in a fresh LocalPipeline over
experiments.bench_engine's PROMPTS after one warm-up request; the sides alternate, their order reversed every
other round. Prints a markdown row per side: the median tokens per second on the emulated clock (wall rate x
time scale), each round's, each pre-drafting drafter's share of changed verdicts a branch foresaw, and whether
its outputs, every round's, equal those of the side without pre-drafting (pre-drafting changes no token).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from experiments.bench_engine import PROMPTS
from experiments.scaling import CHAIN, emulated_config
from pipespec import LocalPipeline
from pipespec.commands.logs import parse_logged
from pipespec.config import PipelineConfig
from pipespec.protocol.stats import merged_stages


@dataclass(frozen=True)
class Side:
    """One placement of pre-drafting, measured."""

    name: str
    rounds: tuple[float, ...]  # tokens per second on the emulated clock
    hit_rates: tuple[float | None, ...]  # per drafter, upstream first, over every round; None: it did not pre-draft
    outputs: tuple[tuple[tuple[int, ...], ...], ...]  # per round, the token ids of each prompt


def placements(depth: int) -> dict[str, tuple[int, ...]]:
    """Side name -> the indices of the drafters that pre-draft."""
    drafters = tuple(range(depth - 1))
    return {"none": (), "first": drafters[:1], "last": drafters[-1:], "all": drafters}


def config_for(depth: int, time_scale: float, predraft: int, which: Sequence[int]) -> PipelineConfig:
    """The emulated chain of `depth` models, the drafters `which` holding `predraft` branches each."""
    base = emulated_config(CHAIN[-depth:], time_scale, lookahead=8)
    return replace(base, stages=tuple(replace(s, predraft=predraft if i in which else 0) for i, s in enumerate(base.stages)))


def measure(depth: int, time_scale: float, rounds: int, predraft: int, tokens: int) -> list[Side]:
    """Every placement, `rounds` times, alternating (see the module docstring)."""
    sides = placements(depth)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    stats: dict[str, list] = {name: [] for name in sides}
    outputs: dict[str, list[tuple[tuple[int, ...], ...]]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            with LocalPipeline(config_for(depth, time_scale, predraft, sides[name])) as pipe:
                pipe.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=tokens)  # warm-up
                start, answers = time.perf_counter(), []
                for prompt in PROMPTS:
                    answers.append(pipe.generate(prompt_token_ids=prompt, max_new_tokens=tokens))
                rates[name].append(sum(len(a.token_ids) for a in answers) / (time.perf_counter() - start) * time_scale)
            stats[name] += [a.stats.stages for a in answers]
            outputs[name].append(tuple(tuple(a.token_ids) for a in answers))
    return [
        Side(
            name,
            tuple(rates[name]),
            tuple(s.predraft_hit_rate if i in which else None for i, s in enumerate(merged_stages(stats[name])[:-1])),
            tuple(outputs[name]),
        )
        for name, which in sides.items()
    ]


def exact(sides: Sequence[Side]) -> bool:
    """Every round of every side gave the same tokens as the first round without pre-drafting."""
    reference = sides[0].outputs[0]
    return all(out == reference for side in sides for out in side.outputs)


def table(sides: Sequence[Side], depth: int, time_scale: float) -> str:
    chain = " -> ".join(m.name for m in CHAIN[-depth:])
    lines = [
        f"{chain}, time scale {time_scale}:",
        "",
        "| pre-drafting | tok/s (median) | x none | rounds | hit rate per drafter | same outputs |",
        "|---|---|---|---|---|---|",
    ]
    none = statistics.median(sides[0].rounds)
    for side in sides:
        tps = statistics.median(side.rounds)
        hits = " / ".join("-" if h is None else f"{h:.0%}" for h in side.hit_rates)
        same = "yes" if exact([sides[0], side]) else "NO"
        lines.append(
            f"| {side.name} | {tps:.2f} | {tps / none:.2f}x | {', '.join(f'{x:.2f}' for x in side.rounds)} | {hits} | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=3, help="models of the emulated chain, the target included (2-4)")
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--predraft", type=int, default=8, help="branches each pre-drafting drafter holds")
    parser.add_argument("--tokens", type=int, default=64)
    args = parse_logged(parser, argv)
    if not 2 <= args.depth <= len(CHAIN):
        parser.error(f"--depth: the emulated chain has 2..{len(CHAIN)} models, got {args.depth}")
    if args.time_scale <= 0:
        parser.error(f"--time-scale: must be > 0 (rates are rescaled by it), got {args.time_scale}")
    for flag, value in (("--rounds", args.rounds), ("--predraft", args.predraft), ("--tokens", args.tokens)):
        if value < 1:
            parser.error(f"{flag}: must be >= 1, got {value}")
    sides = measure(args.depth, args.time_scale, args.rounds, args.predraft, args.tokens)
    print(table(sides, args.depth, args.time_scale))  # a CLI entry point: its output is the table
    return 0 if exact(sides) else 1


if __name__ == "__main__":
    raise SystemExit(main())
