"""experiments.agreeing_family: random models whose agreement lands where it was asked, loaded back through
the real loading code, and a pipeline over them that equals the target alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments.agreeing_family import SETS, Recipe, build_family, main, measure, stage, tokenizer, word, write_config
from experiments.bench import async_name, chains, selected
from experiments.prompt_sets import load_prompts
from pipespec import LocalPipeline, load_config
from pipespec.config import sub_pipeline

ASKED = (0.75, 0.9)
BAND = 0.03  # measured on the calibration's own positions: the bisection lands within a position or two of the rate


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("agreeing")
    return out, build_family(out, Recipe(SETS["cpu"], ASKED, vocab=4096, prompts=4))


def test_the_agreement_lands_in_its_band_and_survives_saving_and_loading(family):
    out, info = family
    drafters, target = info["members"][:-1], info["members"][-1]
    assert [m["name"] for m in info["members"]] == list(SETS["cpu"])
    assert abs(target["agreement"] - 0.98) <= BAND  # with the bare bigram map: its answers depend on context a little
    for m, rate in zip(drafters, ASKED):
        assert m["asked"] == rate and abs(m["agreement"] - rate) <= BAND, m
        assert info["agreement"][f"{m['name']}~{target['name']}"] == pytest.approx(m["agreement"])
    # the saved models, loaded with from_pretrained, agree as they did before saving
    assert measure(out, info) == pytest.approx(info["agreement"], abs=1e-6)
    # larger models differ: wider, deeper
    params = [m["parameters"] for m in info["members"]]
    assert params == sorted(params) and params[0] < params[-1] / 4


def test_a_pipeline_over_the_family_equals_the_target_alone_and_accepts_drafts(family):
    out, info = family
    s, m, t = SETS["cpu"]
    config = load_config(out / f"{s}-{m}-{t}.yaml")
    assert [st.max_lookahead for st in config.stages[:-1]] == [8, 8] and all(st.dtype == "bfloat16" for st in config.stages)
    prompts = [p.text for p in load_prompts(out / "prompts.jsonl")]
    assert len(prompts) == 4
    cases = [{}, {"temperature": 0.8, "seed": 3}]
    with LocalPipeline(sub_pipeline(config, [t])) as alone:
        reference = [[alone.generate(p, max_new_tokens=24, **c) for c in cases] for p in prompts]
    for names in ([m, t], [s, m, t]):
        with LocalPipeline(sub_pipeline(config, names)) as pipe:
            for p, expected in zip(prompts, reference):
                for c, want in zip(cases, expected):
                    got = pipe.generate(p, max_new_tokens=24, **c)
                    assert got.token_ids == want.token_ids, (names, c)
                    assert len(got.token_ids) == 24  # no special token ends an answer early
        pair = {f"{x.drafter}->{x.verifier}": x for x in got.stats.pairs}[f"{m}->{t}"]
        assert pair.num_accepted_tokens > 0
    # the first two models make a pipeline of their own (the device script's short run)
    with LocalPipeline(load_config(out / f"{s}-{m}.yaml")) as pipe:
        assert len(pipe.generate(prompts[0], max_new_tokens=8).token_ids) == 8


def test_the_vocabulary_is_exactly_v_words_and_prompts_round_trip(family):
    out, _ = family
    tok = tokenizer(300)
    assert len(tok) == 300 and tok.convert_ids_to_tokens([0, 1, 2]) == ["<unk>", "<s>", "</s>"]
    assert len({word(i) for i in range(5000)}) == 5000  # made-up words never repeat
    text = load_prompts(out / "prompts.jsonl")[0].text
    saved = tokenizer(4096)
    ids = saved.encode(text)
    assert len(ids) == 32 and min(ids) >= 3 and saved.decode(ids) == text


def test_the_configs_on_a_gpu_share_it_in_eighths_with_drafters_at_one_width(family, tmp_path):
    out, _ = family
    recipe = Recipe(SETS["cpu"], ASKED, device="cuda")
    config = load_config(write_config(tmp_path, recipe, recipe.shapes, {n: out / n for n in recipe.shapes}))  # no CUDA to parse
    *drafters, target = config.stages
    assert all(s.device == "cuda" and s.resources == {"num_cpus": 1, "num_gpus": 0.125} for s in config.stages)
    assert all((d.options.min_width, d.options.max_width) == (8, 8) for d in drafters) and target.options.min_width is None
    assert all(s.options.compile is None and s.options.max_context == 256 for s in config.stages)  # compiled: CUDA graphs
    # every chain the bench would start from it fits on one GPU at once; the device script's two at least
    every = [sub_pipeline(config, names) for names in chains(config)]
    assert sum(s.resources["num_gpus"] for c in every for s in c.stages) <= 1
    s, m, t = SETS["cpu"]
    picked = [c for c in every if selected(async_name(c, "ray"), [f"async {m}->{t}", f"async {s}->{m}->{t}"])]
    assert [len(c.stages) for c in picked] == [2, 3]
    assert stage(s, tmp_path, Recipe(SETS["cpu"], ASKED), False)["compile"] is False  # on the CPU: eager


@pytest.mark.parametrize(
    "recipe, message",
    [
        (Recipe(("cpu-s", "nope"), (0.8,)), "unknown shape 'nope'"),
        (Recipe(("cpu-s",), ()), "a drafter and a target"),
        (Recipe(("cpu-s", "cpu-s"), (0.8,)), "each shape once"),
        (Recipe(("cpu-s", "cpu-m", "cpu-l"), (0.8,)), "one agreement per drafter: 2 drafters"),
        (Recipe(("cpu-s", "cpu-l"), (1.5,)), "rate in \\(0, 1\\), got 1.5"),
        (Recipe(("cpu-s", "cpu-l"), (0.8,), max_context=40), "max_context 40"),
    ],
)
def test_bad_recipes_name_the_bad_value(recipe, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        build_family(tmp_path, recipe)


def test_the_command_line_refuses_a_bad_recipe_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path), "--shapes", "cpu-s", "cpu-l", "--agreement", "0.8", "0.9"])
    assert info.value.code == 2 and "one agreement per drafter" in capsys.readouterr().err
    assert not (tmp_path / "family.json").exists()


def test_the_config_files_name_their_family(family):
    out, info = family
    s, m, t = SETS["cpu"]
    assert [Path(c).name for c in info["configs"]] == [f"{s}-{m}.yaml", f"{s}-{m}-{t}.yaml"]
    raw = yaml.safe_load((out / f"{s}-{m}.yaml").read_text())
    assert raw["stages"][-1]["name"] == m and Path(raw["stages"][-1]["model"]) == (out / m).resolve()
    assert json.loads((out / "family.json").read_text())["recipe"]["shapes"] == list(SETS["cpu"])
