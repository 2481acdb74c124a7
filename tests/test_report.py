"""experiments.report: the plan is checked against the measured best, and the page renders what exists."""

from __future__ import annotations

from experiments import report as results


def _bench(**tps: float) -> dict:
    return {"rows": [{"method": name.replace("_", "->"), "tokens_per_s": v} for name, v in tps.items()]}


def _plan(recommended: tuple[str, ...]) -> dict:
    chains = [{"stages": ["target"], "tokens_per_s": 10.0}, {"stages": ["tiny", "target"], "tokens_per_s": 20.0}]
    return {"recommended": {"stages": list(recommended)}, "chains": chains}


def test_the_plan_agrees_with_the_measured_best():
    bench = _bench(**{"target": 9.0, "sync tiny_target": 15.0, "async target": 8.0, "async tiny_target": 17.0})
    text = results.plan_check(_plan(("tiny", "target")), bench)
    assert "is the measured best" in text
    assert "| tiny -> target (recommended) | 20.0 | - | 17.0 |" in text
    assert "sync" not in text.split("\n\n")[0]  # only asynchronous chains are compared


def test_the_plan_disagreeing_with_the_measured_best_says_by_how_much():
    bench = _bench(**{"async target": 8.0, "async tiny_target": 16.0, "async tiny_dream_target (local)": 20.0})
    text = results.plan_check(_plan(("tiny", "target")), bench)
    assert "is not the measured best (tiny -> dream -> target)" in text and "80%" in text


def test_the_chains_the_plan_tried_show_their_measurement_in_place():
    bench = _bench(**{"async target": 8.0, "async tiny_target": 16.0})
    plan = {**_plan(("tiny", "target")), "trials": [{"candidate": {"stages": ["tiny", "target"]}, "rounds": [14.0, 15.0, 19.0]}]}
    text = results.plan_check(plan, bench)
    assert "| tiny -> target (recommended) | 20.0 | 15.0 | 16.0 |" in text and "| target | 10.0 | - | 8.0 |" in text


def test_the_page_renders_with_nothing_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "BENCH", tmp_path / "bench")
    monkeypatch.setattr(results, "PLAN", tmp_path / "plan.json")
    monkeypatch.setattr(results, "SCALING", tmp_path / "scaling")
    page = results.render()
    assert page.startswith("# Results") and "CPU cores" in page
    assert page.count("_Not measured yet") == 6  # accuracy, ablations, bench, plan, scaling, vlm


def test_the_third_stage_is_weighed_on_a_shared_core():
    """dream alone: 1 / 2 ms = 500 tok/s; tiny in front: 2.5 tokens / (3 ms + 4 x 1 ms) = 357 tok/s."""
    profile = {
        "gamma": 4,
        "stages": [
            {"name": "tiny", "forward_s": 0.001, "verify_s": 0.001},
            {"name": "dream", "forward_s": 0.002, "verify_s": 0.003},
            {"name": "target", "forward_s": 0.010, "verify_s": 0.012},
        ],
        "pairs": [
            {"drafter": "tiny", "verifier": "target", "mean_acceptance_length": 3.0},
            {"drafter": "tiny", "verifier": "dream", "mean_acceptance_length": 2.5},
        ],
    }
    text = results._third_stage(profile)
    assert "dream drafts alone at 500 tok/s" in text and "it drafts 357 tok/s, 0.71x" in text


def test_the_ablation_is_held_to_the_issue_bars():
    def ablation(**tau: float) -> dict:
        return {name: {"mean_acceptance_length": v, "prompts": 48} for name, v in tau.items()}

    met = results._ablation_verdicts(ablation(dream=4.4, no_cross_attention=4.0, **{"compression_0.75": 4.32}))
    assert met == [
        "- DREAM over the EAGLE-style block (no_cross_attention): +10.0% (bar: at least +10%, the paper's gain; met).",
        "- Compression 0.75 against none: -1.8% (bar: at most 2% lower; met).",
    ]
    missed = results._ablation_verdicts(ablation(dream=4.0, no_cross_attention=3.9, **{"compression_0.75": 3.8}))
    assert "+2.6%" in missed[0] and missed[0].endswith("not met).") and missed[1].endswith("not met).")
    assert results._ablation_verdicts(ablation(dream=4.0)) == []


def test_the_ablation_table_shows_each_seed_their_spread_and_each_kind(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    ablation = {
        "dream": {
            "mean_acceptance_length": 4.0, "prompts": 48, "per_seed": [4.1, 3.9], "seeds": [0, 1],
            "per_kind": {"colour": 4.4, "count": 3.6},
        },
        "no_cross_attention": {"mean_acceptance_length": 3.8, "prompts": 48, "per_kind": {"colour": 4.0}},  # no seeds: older
    }  # fmt: skip
    (tmp_path / "dream_ablation.json").write_text(json.dumps(ablation))
    text = results.section_models()
    assert "| dream | 4.000 | +0.0% | 4.100, 3.900 | 0.200 | 48 |" in text
    assert "| no_cross_attention | 3.800 | -5.0% | - | nan | 48 |" in text
    assert "| colour | 4.40 | 4.00 | +10.0% |" in text and "| count | 3.60 | - | - |" in text


def test_the_accuracy_table_shows_intervals_and_bars(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    accuracy = {
        "colour": {"accuracy": 0.95, "interval_95": [0.83, 0.99], "bar": 0.9, "meets_bar": True, "chance": 0.125, "questions": 40},
        "describe_exact": {"accuracy": 0.3, "interval_95": [0.18, 0.45], "bar": None, "meets_bar": None, "chance": 0.0, "questions": 40},
    }  # fmt: skip
    (tmp_path / "demo_target_accuracy.json").write_text(json.dumps(accuracy))
    text = results.section_models()
    assert "| colour | 0.95 | 0.83-0.99 | 0.90 (met) | 0.12 | 40 |" in text
    assert "| describe_exact | 0.30 | 0.18-0.45 | - | 0.00 | 40 |" in text


def test_the_recommended_chain_shows_its_own_placement_and_the_others_their_best():
    """tiny -> target tried on one device (the pick) and on two; the target alone predicted on one placement."""
    one, two = {"stages": ["tiny", "target"], "placement": [["tiny", "target"]]}, {"stages": ["tiny", "target"]}
    plan = {
        "recommended": {**one, "tokens_per_s": 21.0},
        "chains": [{**two, "tokens_per_s": 25.0}, {**one, "tokens_per_s": 21.0}, {"stages": ["target"], "tokens_per_s": 10.0}],
        "trials": [{"candidate": {**one, "tokens_per_s": 21.0}, "rounds": [13.0]}, {"candidate": two, "rounds": [18.0]}],
    }
    text = results.plan_check(plan, _bench(**{"async target": 8.0, "async tiny_target": 16.0}))
    assert "| tiny -> target (recommended, on tiny+target) | 21.0 | 13.0 | 16.0 |" in text
    apart = {**plan, "recommended": {"stages": ["tiny", "target"], "placement": [["tiny"], ["target"]], "tokens_per_s": 25.0}}
    text = results.plan_check(apart, _bench(**{"async tiny_target": 16.0}))
    assert "| tiny -> target (recommended, on tiny \\| target) | 25.0 | 18.0 | 16.0 |" in text  # | escaped in its cell


def test_the_deployment_is_the_why_only_where_it_costs_the_target():
    """Against the faster in-process target: 0.80x is the deployment's cost; 0.98x leaves the gap between stages."""

    def bench(deployed: float) -> dict:
        rows = [("target", 9.0), ("target, 1 thread", 10.0), ("async target", deployed)]
        return {"rows": [{"method": m, "tokens_per_s": v, "prefill_s": 0.05} for m, v in rows]}

    costly = results._deployment(bench(8.0))
    assert costly.startswith("- Why: the deployment itself.") and "0.80x" in costly and "25.0 ms more per token" in costly
    assert "(target, 1 thread)" in costly
    cheap = results._deployment(bench(9.8))
    assert cheap.startswith("- The deployment costs the target little here.") and "0.98x" in cheap and "traces below" in cheap
    assert results._deployment({"rows": [{"method": "target", "tokens_per_s": 9.0, "prefill_s": 0.05}]}) is None
    two_threads_faster = {"rows": [*bench(8.0)["rows"], {"method": "target", "tokens_per_s": 16.0, "prefill_s": 0.05}][1:]}
    costly = results._deployment(two_threads_faster)  # the faster on every core; the actor has one: both ratios
    assert "0.50x the same target decoding in this process (target)" in costly
    assert "Against the same target on one thread, as its actor has: 0.80x." in costly
    assert "Against the same" not in results._deployment(bench(8.0))  # the faster was the one thread itself
