"""The verify budget (pipespec.engine.verify_budget): a forward checks the drafts that pay for their rows.

The choice is the best of all: exhaustive search over every request's draft count finds no higher expected
tokens per second. Free rows (a padded bucket) take every draft; dear rows and a low acceptance take none.
In a pipeline of mocks whose rows cost more than their drafts yield, the target verifies far fewer drafts
than its window, and the answers are the target alone's whatever it chooses.
"""

from __future__ import annotations

import itertools
import random

import pytest

from pipespec import LocalPipeline, load_config
from pipespec.engine.verify_budget import Candidate, ForwardCosts, acceptance, verify_counts
from pipespec.protocol.stats import PairStats


def test_the_cost_of_a_request_and_of_a_row_are_fitted_apart_warm_ups_and_preempted_forwards_left_out():
    rng = random.Random(5)
    costs = ForwardCosts()
    assert costs.estimate(4, 16) is None and not costs.measured  # nothing measured: nothing known
    for i in range(200):
        n = rng.randint(1, 16)
        rows = rng.choice([16, 24, 32, 48])
        seconds = 0.002 + 0.001 * n + 0.0001 * rows + rng.uniform(0, 0.0001)
        if (n, rows) not in costs._warmed or i % 20 == 0:
            seconds *= 10  # a shape's first forward (it compiled), or one preempted
        costs.observe(n, rows, seconds)
    fixed, per_request, per_row = costs.coefficients()
    assert fixed == pytest.approx(0.002, abs=3e-4)
    assert per_request == pytest.approx(0.001, rel=0.05) and per_row == pytest.approx(0.0001, rel=0.1)
    assert costs.estimate(8, 24) == pytest.approx(0.002 + 0.008 + 0.0024, rel=0.05)


def test_forwards_of_one_shape_tell_no_cost_of_a_row_apart_and_none_is_assumed():
    costs = ForwardCosts()
    for _ in range(20):
        costs.observe(16, 64, 0.010)  # a full batch, always the same bucket: a row's own cost is not seen
    assert costs.coefficients()[2] == 0.0
    assert costs.estimate(16, 32) == pytest.approx(0.010)  # not halved with the rows (drafts ride, and are measured)
    for _ in range(20):
        costs.observe(8, 32, 0.006)  # rows a multiple of requests: still no row's own cost
    fixed, per_request, per_row = costs.coefficients()
    assert per_row == 0.0 and per_request == pytest.approx(0.0005) and fixed == pytest.approx(0.002)
    full = ForwardCosts()
    for rows in [8, 40] * 10:
        full.observe(8, rows, 0.001 + 0.002 * rows)  # every forward carries 8: rows alone vary, and are seen
    assert full.coefficients()[2] == pytest.approx(0.002) and full.estimate(8, 24) == pytest.approx(0.049)


def test_no_cost_is_below_zero():
    costs = ForwardCosts()
    for n, rows in itertools.product(range(1, 5), [16, 24, 32]):
        for _ in range(2):  # (the first of each shape is left out)
            costs.observe(n, rows, 0.010 + 0.002 * n - 0.0001 * rows)  # wider and cheaper: noise, not a saving
    fixed, per_request, per_row = costs.coefficients()
    assert per_row == 0.0 and per_request == pytest.approx(0.002, rel=0.2) and fixed > 0


def test_a_request_without_verifications_has_its_stage_rate_and_then_its_own():
    pair = PairStats("d", "v")
    assert acceptance(pair, 0.6) == pytest.approx(0.6)
    for _ in range(20):
        pair.record(4, 0)  # every first draft rejected
    assert acceptance(pair, 0.6) < 0.1
    assert acceptance(PairStats("d", "v"), 1.0) < 1.0  # never certain: a further draft always gains less


def _rate(candidates, counts, cost) -> float:
    expected = sum(sum(c.acceptance**k for k in range(n + 1)) for c, n in zip(candidates, counts))
    return expected / cost(sum(c.rows for c in candidates) + sum(counts))


def test_the_choice_is_the_best_of_every_count_per_request():
    rng = random.Random(3)
    for _ in range(200):
        candidates = [Candidate(rng.randint(1, 2), rng.randint(0, 4), rng.random()) for _ in range(rng.randint(1, 4))]
        latency, per_row, bucket = rng.uniform(0, 10), rng.uniform(0, 2), rng.choice([1, 4, 16])

        def cost(rows, latency=latency, per_row=per_row, bucket=bucket):
            return latency + per_row * (-(-rows // bucket) * bucket)  # rows padded to a multiple of `bucket`

        counts = verify_counts(candidates, cost)
        assert all(0 <= n <= c.drafts for c, n in zip(candidates, counts))
        best = max(_rate(candidates, choice, cost) for choice in itertools.product(*(range(c.drafts + 1) for c in candidates)))
        assert _rate(candidates, counts, cost) == pytest.approx(best)


def test_free_rows_take_every_draft_and_dear_rows_with_low_acceptance_none():
    candidates = [Candidate(1, 4, 0.3), Candidate(1, 4, 0.9)]
    assert verify_counts(candidates, lambda rows: 0.01) == [4, 4]  # one bucket: the rows are free
    assert verify_counts(candidates, lambda rows: None) == [4, 4]  # nothing measured yet: every draft rides
    assert verify_counts([Candidate(1, 4, 0.3)] * 8, lambda rows: 0.001 * rows) == [0] * 8  # every row costs
    # rows dear, one request likely right: its drafts ride, the other's not
    assert verify_counts(candidates, lambda rows: 0.004 + 0.001 * rows) == [0, 4]


def _mocks(adaptive: bool) -> dict:
    """A drafter that agrees with its target a third of the time, a target whose every row costs twice a forward's
    latency (its drafts do not pay for their rows)."""
    target = {"name": "target", "kind": "mock", "latency_ms": 1.0, "per_token_ms": 2.0, "max_batch": 8, "verify_window": 4}
    drafter = {"name": "drafter", "kind": "mock", "agreement": 0.3, "max_lookahead": 8, "max_batch": 8}
    return load_config({"stages": [drafter, {**target, "adaptive_window": adaptive}]})


def test_a_target_whose_rows_cost_more_than_its_drafts_yield_verifies_few_and_answers_the_same():
    alone = load_config({"stages": [{"name": "target", "kind": "mock", "max_batch": 8}]})
    with LocalPipeline(alone) as p:
        reference = [p.generate(prompt_token_ids=[i, 2, 3], max_new_tokens=64).token_ids for i in range(8)]
    drafted = {}
    for adaptive in (False, True):
        with LocalPipeline(_mocks(adaptive)) as p:
            outs = [f.result() for f in [p.submit(prompt_token_ids=[i, 2, 3], max_new_tokens=64) for i in range(8)]]
        assert [o.token_ids for o in outs] == reference
        pairs = [o.stats.pairs[0] for o in outs]
        drafted[adaptive] = sum(p.num_draft_tokens for p in pairs)
    assert drafted[True] < drafted[False] / 2
