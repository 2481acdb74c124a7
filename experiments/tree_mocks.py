"""Draft trees on the emulated chain: the tokens a verification commits, as the tree's probabilities predict them
and as verification measures them.

    python -m experiments.tree_mocks [--agreement 0.7] [--runner-up 0.5] [--third 0.2] [--budgets 3 7 15]
        [--branching 3] [--requests 40] [--tokens 64] [--out DIR]

The mock stages' world (pipespec.stages.mock): at a position the drafter agrees with the target with probability
`agreement` (a); where it does not, the target's token is the drafter's runner-up with probability `runner_up` (r)
and its third with `third` (t). A node of a greedy tree is its parent's first child, second or third (its
children go in the drafter's order: pipespec.engine.tree_drafting), so it is the target's token with probability
a, (1 - a) r or (1 - a) t, given its parent was; the target takes a node's path with the product along it, and a
verification commits 1 + the sum of those products over the tree's nodes. Synchronous speculation
(pipespec.engine.synchronous) grows trees of each budget and verifies them; the prediction is that sum over
every tree it verified. A chain of as many drafts beside (its prediction: 1 + a + a^2 + ..., as far as each
verification's drafts went: fewer near an answer's end), and what the best
tree of as many nodes would commit, knowing a, r and t (the drafter's own values know nothing of them: a mock's
logits are the target's where it agrees, random where not). Mocks emulate no latency here (the count is the point).

Writes tree_mocks.json and tree_mocks.md under --out (default experiments/results/trees).
"""

from __future__ import annotations

import argparse
import heapq
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path

from experiments.results_files import write_results
from pipespec import load_config
from pipespec.commands.logs import parse_logged
from pipespec.engine.draft_tree import ROOT, DraftTree
from pipespec.engine.synchronous import generate_sync
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.protocol.tree_shape import TreeShape
from pipespec.stages.build import load_stages

log = logging.getLogger(__name__)

DEFAULT_OUT = Path("experiments/results/trees")
VOCAB = 64


def predicted(tree: DraftTree, by_rank: Sequence[float]) -> float:
    """The tokens a greedy verification of `tree` commits in expectation: 1 + the sum over its nodes of the product,
    along the node's path, of the chance that each node (by its rank among its siblings) is the target's token."""
    taken = {ROOT: 1.0}
    for node, parent in enumerate(tree.parents):  # parents come first
        rank = tree.children(parent).index(node)
        taken[node] = taken[parent] * (by_rank[rank] if rank < len(by_rank) else 0.0)
    return 1.0 + sum(p for node, p in taken.items() if node != ROOT)


def best(budget: int, by_rank: Sequence[float]) -> float:
    """What the best tree of `budget` nodes would commit, knowing `by_rank`: the `budget` paths of highest product
    (best first: a child is worth at most its parent)."""
    offered = [-p for p in by_rank]  # minus the products of the paths on offer: the root's children first
    heapq.heapify(offered)
    total = 0.0
    for _ in range(budget):
        value = heapq.heappop(offered)
        total -= value
        for p in by_rank:
            heapq.heappush(offered, value * p)
    return 1.0 + total


def run(args: argparse.Namespace) -> list[dict]:
    a, r, t = args.agreement, args.runner_up, args.third
    drafter_options = {"agreement": a, "runner_up": r, "third": t, "vocab_size": VOCAB}
    config = {
        "stages": [
            {"name": "drafter", "kind": "mock", **drafter_options},
            {"name": "target", "kind": "mock", "vocab_size": VOCAB},
        ]
    }
    drafter, target = load_stages(load_config(config))
    by_rank = (a, (1 - a) * r, (1 - a) * t)
    specs = [RequestSpec(f"r{i}", (i + 3, 7, 11), SamplingParams(), args.tokens) for i in range(args.requests)]
    rows = []
    for budget in args.budgets:
        chained = [generate_sync(target, spec, drafter, budget) for spec in specs]
        chain = [n for result in chained for n in result.accept_lengths]
        shape = TreeShape(budget=budget, depth=budget, branching=args.branching)
        results = [generate_sync(target, spec, drafter, tree=shape) for spec in specs]
        lengths = [n for result in results for n in result.accept_lengths]
        trees = [tree for result in results for tree in result.trees]
        rows.append(
            {
                "budget": budget,
                "chain_tokens_per_verification": statistics.fmean(chain),
                "chain_predicted": statistics.fmean(predicted(line, by_rank) for result in chained for line in result.trees),
                "tree_tokens_per_verification": statistics.fmean(lengths),
                "tree_predicted": statistics.fmean(predicted(tree, by_rank) for tree in trees),
                "best_tree_predicted": best(budget, by_rank),
                "verifications": len(lengths),
            }
        )
        log.info("%s", rows[-1])
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"# Draft trees on the emulated chain (agreement {args.agreement}, runner-up {args.runner_up}, third {args.third}; "
        f"{args.requests} requests x {args.tokens} tokens, greedy, branching {args.branching})",
        "",
        "Tokens a verification commits, measured and as the drafts' probabilities predict them.",
        "",
        "| nodes (drafts) | chain measured | chain predicted | tree measured | tree predicted | tree / chain | best tree predicted | verifications |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['budget']} | {r['chain_tokens_per_verification']:.3f} | {r['chain_predicted']:.3f} | "
            f"{r['tree_tokens_per_verification']:.3f} | {r['tree_predicted']:.3f} | "
            f"{r['tree_tokens_per_verification'] / r['chain_tokens_per_verification']:.3f} | {r['best_tree_predicted']:.3f} | "
            f"{r['verifications']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agreement", type=float, default=0.7)
    parser.add_argument(
        "--runner-up", type=float, default=0.5, help="the target's token is the drafter's second, where they differ"
    )
    parser.add_argument("--third", type=float, default=0.2, help="... or its third")
    parser.add_argument("--budgets", type=int, nargs="+", default=[3, 7, 15], help="nodes a tree (drafts a chain)")
    parser.add_argument("--branching", type=int, default=3)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parse_logged(parser, argv)
    rows = run(args)
    write_results(args.out, "tree_mocks", args, rows, markdown(rows, args))


if __name__ == "__main__":
    main()
