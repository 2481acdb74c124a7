"""The committed generated gRPC modules are exactly what `python -m pipespec.protos.build` produces."""

from __future__ import annotations

from pathlib import Path

from pipespec.protos.build import HERE, build


def test_generated_code_is_fresh(tmp_path: Path):
    for fresh in build(tmp_path):
        committed = HERE / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `python -m pipespec.protos.build`"
