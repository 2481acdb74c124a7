"""An experiment's rows written where its results go: as JSON (with the arguments that made them) and as markdown
(`table`: a header over one markdown table)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path


def write_results(out: Path, stem: str, args: argparse.Namespace, rows: list[dict], markdown: str) -> None:
    """`out`/`stem`.json (the arguments and the rows) and `out`/`stem`.md (`markdown`), which is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)


def table(header: str, columns: Sequence[str], cells: Iterable[Sequence[object]]) -> str:
    """`header`, a blank line, then a markdown table of `columns` and a row of `cells` each (formatted already)."""
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    return "\n".join(lines) + "\n"
