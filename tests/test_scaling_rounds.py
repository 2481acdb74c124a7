"""experiments.scaling_rounds: medians over rounds, each side in its own column."""

from __future__ import annotations

import json

from experiments.scaling_rounds import main, table


def _run(tmp_path, name, tps, sync, hit, key="predraft_hit_rates"):
    """`key`: the runs before every drafter pre-drafted wrote the first's rate alone, as predraft_hit_rate."""
    hits = hit if key == "predraft_hit_rate" or hit is None else [hit]
    rows = [
        {"devices": 1, "chain": "70B", "tokens_per_s": 7.0, "sync_tokens_per_s": None, "gap": -0.02, key: None, "exact": True},
        {"devices": 2, "chain": "8B -> 70B", "tokens_per_s": tps, "sync_tokens_per_s": sync, "gap": -0.1, key: hits, "exact": True},
    ]  # fmt: skip
    if key == "predraft_hit_rates" and hit is not None:
        three = {"devices": 3, "chain": "1B -> 8B -> 70B", "tokens_per_s": tps, "sync_tokens_per_s": sync, "gap": 0.0}
        rows.append({**three, key: [hit / 4, hit], "exact": True})
    (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))


def test_each_side_is_the_median_of_its_rounds(tmp_path, capsys):
    for r, (off, on) in enumerate([(13.0, 16.0), (14.0, 15.0), (20.0, 17.0)], 1):
        _run(tmp_path, f"0.1_p0_r{r}", off, 10.0, None)
        _run(tmp_path, f"0.1_p8_r{r}", on, 10.0, 0.4)
    out = table(tmp_path)
    assert (
        "| 0.1 | 8B -> 70B | 14.00 (1.40x) | 16.00 (1.60x) | 40% | 16.0 / 10.0, 15.0 / 10.0, 17.0 / 10.0 | -10% / -10% | yes |"
        in out
    )
    assert "| 0.1 | 70B | 7.00 | 7.00 | - | - | -2% / -2% | yes |" in out
    assert "| 0.1 | 1B -> 8B -> 70B | - | 16.00 (1.60x) | 10% / 40% |" in out  # a rate per pair, upstream first
    assert main([str(tmp_path), "--log-level", "WARNING"]) == 0
    assert capsys.readouterr().out.strip() == out


def test_runs_with_the_first_drafters_rate_alone_still_render(tmp_path):
    for r, hit in enumerate([0.3, 0.5, 0.4], 1):
        _run(tmp_path, f"0.03_p0_r{r}", 9.0, 10.0, None, key="predraft_hit_rate")
        _run(tmp_path, f"0.03_p8_r{r}", 8.0, 10.0, hit, key="predraft_hit_rate")
    assert "| 0.03 | 8B -> 70B | 9.00 (0.90x) | 8.00 (0.80x) | 40% |" in table(tmp_path)
