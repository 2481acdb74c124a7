"""experiments.results: the plan is checked against the measured best, and the page renders what exists."""

from __future__ import annotations

from experiments import results


def _bench(**tps: float) -> dict:
    return {"rows": [{"method": name.replace("_", "->"), "tokens_per_s": v} for name, v in tps.items()]}


def _plan(recommended: tuple[str, ...]) -> dict:
    chains = [{"stages": ["target"], "tokens_per_s": 10.0}, {"stages": ["tiny", "target"], "tokens_per_s": 20.0}]
    return {"recommended": {"stages": list(recommended)}, "chains": chains}


def test_the_plan_agrees_with_the_measured_best():
    bench = _bench(**{"target": 9.0, "sync tiny_target": 15.0, "async target": 8.0, "async tiny_target": 17.0})
    text = results.plan_check(_plan(("tiny", "target")), bench)
    assert "is the measured best" in text
    assert "| tiny -> target (recommended) | 20.0 | 17.0 |" in text
    assert "sync" not in text.split("\n\n")[0]  # only asynchronous chains are compared


def test_the_plan_disagreeing_with_the_measured_best_says_by_how_much():
    bench = _bench(**{"async target": 8.0, "async tiny_target": 16.0, "async tiny_dream_target (local)": 20.0})
    text = results.plan_check(_plan(("tiny", "target")), bench)
    assert "is not the measured best (tiny -> dream -> target)" in text and "80%" in text


def test_the_page_renders_with_nothing_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "BENCH", tmp_path / "bench")
    monkeypatch.setattr(results, "PLAN", tmp_path / "plan.json")
    monkeypatch.setattr(results, "SCALING", tmp_path / "scaling")
    page = results.render()
    assert page.startswith("# Results") and "CPU cores" in page
    assert page.count("_Not measured yet") == 6  # accuracy, ablations, bench, plan, scaling, vlm
