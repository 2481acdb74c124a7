"""Where a drafter ranks its target's token: what pre-drafting (pipespec.engine.outcome_cache) can win.

    python -m dev.draft_ranks [CONFIG] [--prompts FILE] [--limit 12] [--tokens 96] [--out DIR]

For each drafter of CONFIG (default: the demo's), straight before the target: the target alone answers
each prompt (greedy); the drafter is then fed that answer one token at a time, as it would draft it
(a DREAM drafter with the target's features of everything before, `FeaturedVerifier`: its best-informed
case), and at every position we note the rank of the target's token in the drafter's logits. Rank 1 is
acceptance; at the other positions (the rejections), the share of rank 2 is how often a branch keyed on
the drafter's runner-up would be the right one, and of ranks 2 and 3 the most two branches a position
(pipespec.engine.outcome_cache.ALTERNATIVES) can hit. The mock stages' `runner_up` and `third` options
(pipespec.schema.kinds.MockOptions) emulate these shares.

Writes draft_ranks.json and draft_ranks.md under --out (default experiments/results/predraft).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from experiments.prompt_sets import Prompt, load_prompts
from experiments.results_files import table
from pipespec import LocalPipeline, load_config
from pipespec.commands.logs import parse_logged
from pipespec.config import PipelineConfig, sub_pipeline
from pipespec.engine.handoff import FeaturedVerifier
from pipespec.engine.stage import Stage
from pipespec.engine.synchronous import generate_sync
from pipespec.stages.build import load_stages

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "pipespec/configs/demo_two_cores.yaml"
DEFAULT_PROMPTS = "experiments/prompts/world_held_out.jsonl"
DEFAULT_OUT = Path("experiments/results/predraft")
TOP = 5  # ranks counted one by one; the rest as "beyond"


def ranks(config: PipelineConfig, prompts: Sequence[Prompt], tokens: int) -> Counter:
    """config: drafter -> target. -> how many positions of the target's answers the drafter ranked 1, 2, ..
    (ranks past TOP counted at TOP + 1)."""
    drafter, target = load_stages(config)
    if config.sends_features(1):
        drafter = FeaturedVerifier(drafter, target)
    counts: Counter = Counter()
    with LocalPipeline(config, stages=[getattr(drafter, "dream", drafter), target]) as pipe:  # its tokenizer and images
        for p in prompts:
            spec, _ = pipe.request(prompt=p.text, max_new_tokens=tokens, **({"image": str(p.image)} if p.image else {}))
            answer = generate_sync(target, spec).token_ids
            counts.update(_answer_ranks(drafter, spec, answer))
    return counts


def _answer_ranks(drafter: Stage, spec, answer: list[int]) -> list[int]:
    session = drafter.open(spec)
    try:
        fed = session.prompt_len - 1
        previous = [session.last_prompt_token, *answer]
        out = []
        for i, token in enumerate(answer):
            logits = session.forward(fed + i, [previous[i]])[-1]  # [V]
            out.append(min(int((logits > logits[token]).sum()) + 1, TOP + 1))
        return out
    finally:
        session.close()


def summary(name: str, counts: Counter) -> dict:
    n = sum(counts.values())
    rejected = n - counts[1]
    return {
        "drafter": name,
        "positions": n,
        "rank_share": {str(r): counts[r] / n for r in range(1, TOP + 2)},
        "rejections": rejected,
        "runner_up_given_rejection": counts[2] / rejected if rejected else 0.0,
        "top3_given_rejection": (counts[2] + counts[3]) / rejected if rejected else 0.0,
    }


def markdown(rows: list[dict], header: str) -> str:
    columns = ["drafter", "positions", "rank 1 (accepted)", "rank 2", "rank 3", "beyond", "rejections"]
    columns += ["runner-up at a rejection", "top 3 at a rejection"]

    def cells(r: dict) -> list[object]:
        share = r["rank_share"]
        beyond = sum(v for k, v in share.items() if int(k) > 3)
        ranks = [f"{share[k]:.3f}" for k in ("1", "2", "3")]
        return [r["drafter"], r["positions"], *ranks, f"{beyond:.3f}", r["rejections"]] + [
            f"{r['runner_up_given_rejection']:.3f}",
            f"{r['top3_given_rejection']:.3f}",
        ]

    return table(header, columns, map(cells, rows))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="pipeline config (its drafters and target)")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prompt file (jsonl, experiments.prompt_sets)")
    parser.add_argument("--limit", type=int, default=12, help="how many prompts")
    parser.add_argument("--tokens", type=int, default=96, help="most new tokens per answer")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where draft_ranks.json and .md go")
    args = parse_logged(parser, argv)
    torch.set_num_threads(1)
    config = load_config(args.config)
    prompts = load_prompts(args.prompts, limit=args.limit)
    rows = []
    for drafter in config.stages[:-1]:
        rows.append(summary(drafter.name, ranks(sub_pipeline(config, [drafter.name, config.target.name]), prompts, args.tokens)))
        log.info("%s: %s", drafter.name, rows[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_ranks.json").write_text(json.dumps(rows, indent=2) + "\n")
    header = (
        f"Where each drafter of `{config.name}` ranks the target's greedy token ({len(prompts)} prompts of "
        f"{args.prompts}, up to {args.tokens} tokens; `python -m dev.draft_ranks {args.config} --limit {args.limit} "
        f"--tokens {args.tokens}`)."
    )
    md = markdown(rows, header)
    (args.out / "draft_ranks.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
