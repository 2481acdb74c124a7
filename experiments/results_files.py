"""An experiment's rows written where its results go: as JSON (with the arguments that made them) and as markdown."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_results(out: Path, stem: str, args: argparse.Namespace, rows: list[dict], markdown: str) -> None:
    """`out`/`stem`.json (the arguments and the rows) and `out`/`stem`.md (`markdown`), which is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
