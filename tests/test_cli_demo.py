"""`pipespec demo`'s helpers (pipespec/cli/demo.py) that need no Ray: the truth printed under the answer,
what it refuses before anything starts, the report it returns."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from pipespec.cli import main
from pipespec.cli.demo import DemoReport, DemoSetup, demo_config, demo_request, picture_truth
from pipespec.commands.examples import config_path
from pipespec.config import load_config, with_stages
from pipespec.protocol.stats import PairStats, merged_pairs
from tests.fixtures import DEMO_MODELS


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


def test_what_the_demo_cannot_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["demo", "--models", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err == f"pipespec demo: no demo models under {tmp_path}; train them with `python -m demo.train all`\n"
    )
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a picture")
    assert main(["demo", "--models", str(DEMO_MODELS), "--image", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipespec demo: ") and err.count("\n") == 1


def test_pairs_are_merged_over_requests_in_pipeline_order():
    first = [PairStats("tiny", "dream", 1, 4, 3, 1, [1, 1, 1]), PairStats("dream", "target", 1, 2, 2, 0, [1, 1])]
    second = [PairStats("tiny", "dream", 2, 8, 4, 2, [2, 1, 1])]
    merged = merged_pairs([first, second])
    assert [(p.drafter, p.verifier) for p in merged] == [("tiny", "dream"), ("dream", "target")]
    assert (merged[0].num_drafts, merged[0].num_accepted_tokens, merged[0].accepted_per_position) == (3, 7, [3, 2, 2])
    assert first[0].num_drafts == 1  # the inputs are left as they were


def test_the_report_holds_the_figures_and_renders_them():
    pair = PairStats("tiny", "target", num_drafts=2, num_draft_tokens=8, num_accepted_tokens=6)
    config = load_config(config_path("mock3"))
    report = DemoReport(pipeline=(20.0, 30.0), alone=(10.0, 10.0), exact=True, pairs=(pair,), threads=2, config=config)
    figures = report.as_dict()
    assert figures["speedup_vs_target"] == 2.5 and figures["tokens_per_second"] == 25.0 and figures["exact"] is True
    assert figures["pairs"] == [
        {"drafter": "tiny", "verifier": "target", "num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 6,
         "mean_acceptance_length": 4.0}
    ]  # fmt: skip
    lines = report.lines()
    assert lines[1].split() == ["1", "20.0", "10.0", "2.00x"] and lines[5].split()[:2] == ["tiny", "->"]
    assert "(medians of 2 alternating runs): speedup 2.50x" in lines[-1]
    assert lines[-1].endswith("identical to the target alone: yes")


def test_a_plan_that_picks_the_target_alone_is_not_called_a_speedup():
    alone = demo_config(DEMO_MODELS, ["target"], "float32", 1.0)
    report = DemoReport(pipeline=(12.0,), alone=(10.0,), exact=True, pairs=(), threads=1, config=alone)
    assert report.lines()[-1].startswith("no pipeline with drafters measured faster than the target alone here")
    chain = demo_config(DEMO_MODELS, ["tiny", "target"], "float32", 1.0)
    assert "identical to the target alone" in DemoReport((12.0,), (10.0,), True, (), 1, chain).lines()[-1]


def test_the_target_alone_may_use_every_core_the_demo_was_given():
    """A plan for 2 devices that picks a pipeline on one leaves a core idle: the target alone is not denied it."""
    pair = demo_config(DEMO_MODELS, ["tiny", "target"], "float32", 1.0)
    one_device = with_stages(pair, [replace(s, device_group="d") for s in pair.stages])  # tiny+target
    assert one_device.cpus() == 1.0
    setup = DemoSetup(demo_request(DEMO_MODELS), one_device, "float32", cores=2.0)
    assert setup.threads == 2
    assert "target alone: in this process, at the faster of 1 and 2 torch threads (the demo's cores)" in setup.lines()


def test_the_demo_plans_by_default_as_make_demo_runs_it():
    """`pipespec demo` with no flags is `make demo`: the planner's chain and placement; serve plans only when asked."""
    from pipespec.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["demo"]).plan == "auto" and parser.parse_args(["demo", "--plan", "none"]).plan == "none"
    assert parser.parse_args(["serve", "mock3"]).plan == "none"
    make_demo = (Path(__file__).resolve().parents[1] / "Makefile").read_text().split("\ndemo:", 1)[1].splitlines()[1]
    assert make_demo.split() == ["$(VENV)/bin/pipespec", "demo"]
