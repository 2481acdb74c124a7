"""The demo target's accuracy report (demo/evaluate.py): intervals, bars, and a run on the shipped target; and the
shipped target describing the shipped picture right."""

from __future__ import annotations

import json

import pytest

from demo.evaluate import BARS, KindScore, evaluate_target, summary, wilson
from demo.talk import TEXT
from demo.train import example_scene
from demo.world import KINDS, describes_exactly
from pipespec import LocalPipeline, load_config
from pipespec.cli.demo import DEFAULT_PROMPT
from tests.fixtures import DEMO_MODELS as MODELS


def test_wilson_intervals():
    assert wilson(36, 40) == pytest.approx((0.7695, 0.9604), abs=1e-4)  # the textbook 90% of 40
    assert wilson(20, 40) == pytest.approx((0.3520, 0.6480), abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(90, 100)
    assert low < 0.9 < high and high - low < wilson(9, 10)[1] - wilson(9, 10)[0]  # more questions, narrower


def test_a_kind_s_score_says_whether_it_meets_its_bar():
    met = KindScore(37, 40, 0.125, 0.9).as_dict()
    assert met["accuracy"] == 37 / 40 and met["meets_bar"] is True and met["interval_95"] == list(wilson(37, 40))
    assert KindScore(35, 40, 0.125, 0.9).as_dict()["meets_bar"] is False
    assert KindScore(3, 40, 0.0, None).as_dict()["meets_bar"] is None
    assert set(BARS) == {*KINDS, TEXT}


def test_the_report_covers_every_kind_and_the_strict_describe():
    report = evaluate_target(MODELS, per_kind=1, seed=0, max_new_tokens=48)
    assert list(report) == [*KINDS, TEXT, "describe_exact"]
    assert all(r["questions"] == 1 and r["right"] in (0, 1) for r in report.values())
    assert report["describe_exact"]["right"] <= report["describe"]["right"]  # strict implies lenient
    for r in report.values():
        assert len(r["wrong_answers"]) == 1 - r["right"]
        assert all({"prompt", "truth", "answer"} <= set(w) for w in r["wrong_answers"])
    lines = summary(report)
    assert len(lines) == len(KINDS) + 2 and lines[0].startswith("describe") and "held-out questions" in lines[0]


def test_the_shipped_target_describes_the_shipped_picture_exactly():
    """What `pipespec demo` asks by default: every shape's size, colour and place, the background and the word."""
    scene = example_scene()
    assert scene.truth() == json.loads((MODELS / "example.json").read_text())["truth"]  # the picture shipped is this scene
    stage = {"name": "target", "kind": "vlm", "model": str(MODELS / "target"), "dtype": "float32", "compile": False}
    with LocalPipeline(load_config({"stages": [stage]})) as pipe:
        answer = pipe.generate(DEFAULT_PROMPT, image=str(MODELS / "example.png"), max_new_tokens=96).text
    assert describes_exactly(scene, answer), answer
