"""`pipespec demo`'s helpers (pipespec/cli/demo.py) that need no Ray: the truth printed under the answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipespec.cli.demo import DEMO_MODELS, picture_truth


def test_the_shipped_picture_s_truth_is_found_by_its_bytes(tmp_path):
    recorded = json.loads((DEMO_MODELS / "example.json").read_text())
    assert picture_truth(DEMO_MODELS, None) == recorded["truth"]  # the default picture
    copy = tmp_path / "copy.png"
    shutil.copy(DEMO_MODELS / "example.png", copy)
    assert picture_truth(DEMO_MODELS, str(copy)) == recorded["truth"]  # the same picture under another name
    assert picture_truth(DEMO_MODELS, copy) == recorded["truth"]
    other = tmp_path / "other.png"
    other.write_bytes(copy.read_bytes() + b"\0")
    assert picture_truth(DEMO_MODELS, str(other)) is None  # another picture: no truth to print
    assert picture_truth(DEMO_MODELS, str(tmp_path / "missing.png")) is None


def test_no_truth_without_its_record(tmp_path):
    shutil.copy(DEMO_MODELS / "example.png", tmp_path / "example.png")
    assert picture_truth(Path(tmp_path), None) is None
