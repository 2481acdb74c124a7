"""Medians over rounds of emulated scaling sweeps, with and without pre-drafting, side by side.

    python -m experiments.scaling_rounds DIR

DIR holds the JSON of `experiments.scaling` runs, one file per run, named <time scale>_p<predraft>_r<round>.json
(experiments/results/predraft/tree/README.md says how they were made: the sides alternated, round by round).
Prints one markdown row per (time scale, chain): each side's median tokens per second and its median ratio over
the best synchronous speculation measured in the same run, each drafter's hit rate, every round's pair,
and the median gap to the chain model.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from pipespec.commands.logs import parse_logged

HEADER = (
    "| time scale | chain | predraft 0: tok/s (x best sync) | predraft N: tok/s (x best sync) | hit rate per pair | rounds, predraft N:"
    " async / sync | gap to the chain model (0 / N) | exact |\n|---|---|---|---|---|---|---|---|"
)


def _side(rows: list[dict]) -> tuple[str, str]:
    """-> (median tok/s with its median ratio over sync, median gap), or dashes."""
    if not rows:
        return "-", "-"
    tps, gap = statistics.median(r["tokens_per_s"] for r in rows), statistics.median(r["gap"] for r in rows)
    synced = [r["tokens_per_s"] / r["sync_tokens_per_s"] for r in rows if r["sync_tokens_per_s"]]
    return (f"{tps:.2f} ({statistics.median(synced):.2f}x)" if synced else f"{tps:.2f}"), f"{gap:+.0%}"


def _hit_rates(row: dict) -> list[float]:
    """A row's hit rate per pre-drafting drafter, upstream first (runs before every drafter pre-drafted: the first's)."""
    if "predraft_hit_rates" in row:
        return row["predraft_hit_rates"] or []
    return [] if row["predraft_hit_rate"] is None else [row["predraft_hit_rate"]]


def table(directory: Path) -> str:
    by: dict[tuple[float, int, str], dict[bool, list[dict]]] = defaultdict(lambda: {False: [], True: []})
    for path in sorted(directory.glob("*_p*_r*.json")):
        scale, predraft, _ = path.stem.rsplit("_", 2)
        for row in json.loads(path.read_text())["rows"]:
            by[float(scale), row["devices"], row["chain"]][predraft != "p0"].append(row)
    lines = [HEADER]
    for (scale, _, chain), sides in sorted(by.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        (off, off_gap), (on, on_gap) = _side(sides[False]), _side(sides[True])
        hits = [rates for r in sides[True] if (rates := _hit_rates(r))]
        rounds = ", ".join(
            f"{r['tokens_per_s']:.1f} / {r['sync_tokens_per_s']:.1f}" for r in sides[True] if r["sync_tokens_per_s"]
        )
        exact = "yes" if all(r["exact"] for side in sides.values() for r in side) else "NO"
        hit = " / ".join(f"{statistics.median(pair):.0%}" for pair in zip(*hits)) if hits else "-"
        lines.append(f"| {scale} | {chain} | {off} | {on} | {hit} | {rounds or '-'} | {off_gap} / {on_gap} | {exact} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    args = parse_logged(parser, argv)
    print(table(args.directory))  # a CLI entry point: its output is the table
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
