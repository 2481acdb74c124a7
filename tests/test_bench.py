"""experiments.bench and experiments.prompt_sets: every method side by side, the files users read, bad input."""

from __future__ import annotations

import json
import re

import pytest

import experiments.bench as bench
from experiments.bench import Settings, chains, run_bench, selected
from experiments.prompt_sets import WORLD_PROMPTS, load_prompts
from pipespec import load_config
from pipespec.config import ConfigError, sub_pipeline

SPEC_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a story about a cat.", "Now shorter."]},
    {"question_id": 82, "category": "qa", "turns": ["What is the capital of France?"]},
]


def _config(family: dict) -> dict:
    stage = {"dtype": "float32", "max_lookahead": 4}
    return {
        "name": "toy",
        "stages": [
            {"name": "tiny", "kind": "causal_lm", "model": family["tiny"], "predraft": 2, **stage},
            {"name": "mid", "kind": "causal_lm", "model": family["mid"], **stage},
            {"name": "target", "kind": "causal_lm", "model": family["target"], **stage},
        ],
    }


def test_every_method_runs_and_equals_the_target_alone(family, tmp_path):
    prompts_file = tmp_path / "question.jsonl"
    prompts_file.write_text("\n".join(json.dumps(q) for q in SPEC_BENCH) + "\n")
    out = tmp_path / "out"
    rows = run_bench(load_config(_config(family)), load_prompts(prompts_file), Settings(2, 12, 3, "local"), out)
    names = [r.method for r in rows]
    assert names == [
        "target", "target, 1 thread", "sync tiny->target", "sync mid->target", "sync tiny->target, 1 thread",
        "sync mid->target, 1 thread", "hf-generate target", "hf-generate target, 1 thread", "hf-assisted tiny->target", "hf-assisted mid->target",
        "async target (local)", "async tiny->target (local)", "async mid->target (local)", "async tiny->mid->target (local)",
    ]  # fmt: skip
    assert all(r.exact == 1.0 for r in rows), [(r.method, r.exact) for r in rows]
    assert max(rows[0].speedup, rows[1].speedup) == 1.0 and all(r.tokens_per_s > 0 and r.prefill_s > 0 for r in rows)
    three = rows[-1]
    assert set(three.mean_acceptance_length) == {"tiny->mid", "mid->target"}
    # the mid drafter is the target's first 4 layers: it gets drafts accepted
    assert rows[3].mean_acceptance_length["mid->target"] > 1.0
    # tiny pre-drafts where it is first (its verdicts met with its branches), and only there
    by_name = {r.method: r for r in rows}
    assert re.fullmatch(r"tiny \d+% of [1-9]\d* \(\d+ tokens\)", by_name["async tiny->target (local)"].predraft)
    assert by_name["async mid->target (local)"].predraft is None and by_name["sync tiny->target"].predraft is None
    for name in ("bench.md", "bench.json", "bench.png"):
        assert (out / name).stat().st_size > 0
    assert {p.name for p in out.glob("*.jsonl")} >= {"sync_tiny-target.jsonl", "target_1_thread.jsonl"}  # plain names
    assert "async_tiny-mid-target_local.jsonl" in {p.name for p in out.glob("*.jsonl")}
    lines = [json.loads(line) for line in (out / "sync_tiny-target.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2  # prompts x runs
    choice = lines[0]["choices"][0]
    assert lines[0]["question_id"] == 81 and lines[0]["category"] == "writing"
    assert choice["new_tokens"][0] == sum(choice["accept_lengths"]) > 0 and choice["wall_time"][0] > 0
    assert isinstance(choice["turns"][0], str)
    table = (out / "bench.md").read_text()
    assert "| async tiny->mid->target (local) |" in table and "prefill s" in table and "| pre-drafted hits |" in table
    assert "**async tiny->mid->target (local)** on one process" in table  # its trace (pipespec.engine.trace)
    assert "| mid | " in table.split("**async tiny->mid->target (local)**")[1]


def test_only_picks_by_the_start_of_a_word_and_the_target_alone_always():
    names = ["target", "target, 1 thread", "sync tiny->target", "sync tiny->target, 1 thread", "async tiny->target",
             "async tiny->mid->target (local)", "hf-assisted tiny->target"]  # fmt: skip
    assert [n for n in names if selected(n, ())] == names
    assert [n for n in names if selected(n, ["sync tiny"])] == ["target", "sync tiny->target", "sync tiny->target, 1 thread"]
    assert [n for n in names if selected(n, ["async tiny"])] == [
        "target",
        "async tiny->target",
        "async tiny->mid->target (local)",
    ]
    assert [n for n in names if selected(n, ["tiny->target"])] == [
        "target", "sync tiny->target", "sync tiny->target, 1 thread", "async tiny->target", "hf-assisted tiny->target"
    ]  # fmt: skip
    assert [n for n in names if selected(n, ["iny"])] == ["target"]  # not the middle of a word
    assert [n for n in names if selected(n, ["sync tiny->target$"])] == ["target", "sync tiny->target"]  # to the end


def test_only_starts_only_the_picked_pipelines_and_the_tables_are_written_after_every_run(family, tmp_path, monkeypatch):
    prompts_file = tmp_path / "question.jsonl"
    prompts_file.write_text(json.dumps(SPEC_BENCH[1]) + "\n")
    started, headers = [], []

    class Counted(bench.LocalPipeline):
        def __init__(self, config, *args, **kwargs):
            started.append(config.name)
            super().__init__(config, *args, **kwargs)

    write = bench.write
    monkeypatch.setattr(bench, "LocalPipeline", Counted)

    def noted(out, header, *rest, **kwargs):
        headers.append(header)
        write(out, header, *rest, **kwargs)

    monkeypatch.setattr(bench, "write", noted)
    settings = Settings(2, 6, 3, "local", only=("async tiny->target",))
    rows = run_bench(load_config(_config(family)), load_prompts(prompts_file), settings, tmp_path / "out")
    assert [r.method for r in rows] == ["target", "async tiny->target (local)"]
    assert started == ["toy", "toy[tiny->target]"]  # the stages the in-process methods use, and one pipeline
    assert len(headers) == 4  # after each method's pass through the prompts, each run
    assert ["run 1 of 2 under way" in h for h in headers] == [True, True, False, False]
    assert "run 2 of 2 under way" in headers[2] and "under way" not in headers[3]
    assert [r["runs"] for r in json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]] == [2, 2]


def test_a_pipeline_that_cannot_start_is_a_failed_row_and_the_others_run(family, tmp_path, monkeypatch):
    prompts_file = tmp_path / "question.jsonl"
    prompts_file.write_text(json.dumps(SPEC_BENCH[1]) + "\n")

    class Broken(bench.LocalPipeline):
        def __init__(self, config, *args, **kwargs):
            if config.name == "toy[mid->target]":
                raise RuntimeError("out of memory")
            super().__init__(config, *args, **kwargs)

    monkeypatch.setattr(bench, "LocalPipeline", Broken)
    settings = Settings(1, 6, 3, "local", only=("async tiny->target", "async mid->target"))
    rows = run_bench(load_config(_config(family)), load_prompts(prompts_file), settings, tmp_path / "out")
    assert [r.method for r in rows] == ["target", "async tiny->target (local)"]
    table = (tmp_path / "out" / "bench.md").read_text()
    assert "- async mid->target (local) did not run: it did not start (RuntimeError: out of memory)" in table


def test_exact_compares_each_method_with_the_target_alone_on_as_many_threads():
    from experiments.bench import Answer, tabulate

    def run(tokens):  # one run of one prompt
        return [[Answer(1, tokens, 1.0, 0.1, (len(tokens),), ())]]

    results = {
        "target": run((1, 2, 3)), "target, 1 thread": run((1, 2, 4)),  # the two thread counts disagree at a near-tie
        "sync d->target": run((1, 2, 3)), "async d->target": run((1, 2, 4)), "hf-generate target, 1 thread": run((1, 2, 3)),
    }  # fmt: skip
    threads = {"target": 2, "target, 1 thread": 1, "sync d->target": 2, "async d->target": 1, "hf-generate target, 1 thread": 1}
    exact = {r.method: r.exact for r in tabulate(results, threads)}
    assert exact == {
        "target": 1.0, "target, 1 thread": 1.0, "sync d->target": 1.0, "async d->target": 1.0, "hf-generate target, 1 thread": 0.0
    }  # fmt: skip
    # without the threads, or without the one-thread row, everything is compared with the target on every core
    assert {r.method: r.exact for r in tabulate(results)}["async d->target"] == 0.0
    del results["target, 1 thread"]
    assert {r.method: r.exact for r in tabulate(results, threads)}["async d->target"] == 0.0


def test_chains_and_sub_pipelines(family):
    config = load_config(_config(family))
    assert chains(config) == [["target"], ["tiny", "target"], ["mid", "target"], ["tiny", "mid", "target"]]
    assert [s.name for s in sub_pipeline(config, ["target", "tiny"]).stages] == ["tiny", "target"]
    with pytest.raises(ConfigError, match="'nope'"):
        sub_pipeline(config, ["nope", "target"])
    assert sub_pipeline(config, ["tiny", "mid"]).target.name == "mid"  # the last stage kept is the target


def test_the_shipped_world_prompts_load_with_their_pictures():
    prompts = load_prompts(WORLD_PROMPTS)
    assert len(prompts) >= 12 and {p.category for p in prompts} >= {"describe", "count", "colour", "where", "read"}
    assert all(p.image is not None and p.image.is_file() for p in prompts)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"question_id": 1, "category": "x"}', "neither Spec-Bench"),
        ('{"question_id": 1, "turns": []}', "non-empty list"),
        ('{"question_id": 1, "text": "hi", "image": "missing.png"}', "'missing.png' not found"),
        ('{"text": "hi"}', "no question_id"),
    ],
)
def test_bad_prompt_files_name_the_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(SPEC_BENCH[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_prompts(path)
    assert f"{path}:2" in str(info.value)


def test_missing_and_empty_prompt_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(tmp_path / "empty.jsonl")
