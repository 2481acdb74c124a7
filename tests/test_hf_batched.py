"""dev.hf_batched: Hugging Face `generate` on left-padded batches of the demo's questions, the outside reference."""

from __future__ import annotations

import pytest

from dev.hf_batched import main


@pytest.mark.slow
def test_each_batch_size_is_a_row_and_a_batch_of_one_answers_as_itself(tmp_path, capsys):
    out = tmp_path / "hf.md"
    args = ["--batch", "1", "3", "--requests", "3", "--max-tokens", "6", "--runs", "1", "--threads", "1", "--out", str(out)]
    assert main([*args, "--log-level", "WARNING"]) == 0
    rows = [
        line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "batch |" not in line
    ]
    assert [r[0].strip() for r in rows] == ["1", "3"]
    for _, tps, _, first_ms, step_ms, _ in rows:
        assert float(tps) > 0 and float(first_ms) > 0 and float(step_ms) > 0
    assert rows[0][2].strip() == "1.00x" and rows[0][5].strip() == "3/3"  # batch 1 against itself
    assert out.read_text().splitlines()[-1] == "|" + "|".join(rows[-1]) + "|"


@pytest.mark.parametrize(
    "flag, value, error", [("--requests", "0", "--requests: at least 1, got 0"), ("--batch", "0", "--batch: every size")]
)
def test_a_bad_count_is_refused_by_name(flag, value, error, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([flag, value])
    assert exit_.value.code == 2 and error in capsys.readouterr().err
