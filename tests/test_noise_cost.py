"""dev/noise_cost.py: both sides of the comparison give the same tokens, and a side is undone after use."""

from dev import noise_cost
from pipespec.engine import noise


def test_both_sides_generate_the_same_tokens_and_the_noise_is_restored(family):
    built = noise.uniform_rows
    rates, same = noise_cost.pipeline_rates({n: family[n] for n in ("tiny", "target")}, rounds=1, new_tokens=8)
    assert same and all(len(runs) == 1 and runs[0] > 0 for runs in rates.values())
    assert noise.uniform_rows is built


def test_as_it_was_is_as_built_bit_for_bit():
    for rows, num in [(1, 4), (2, 20), (5, 700)]:
        assert noise_cost.SIDES["as it was"](3, 9, rows, num, 1).equal(noise.uniform_rows(3, 9, rows, num, 1))
