"""experiments/tree_mocks.py: what a tree's probabilities predict, and the measurement on mocks matching it."""

from __future__ import annotations

import argparse

import pytest

from experiments.tree_mocks import best, markdown, predicted, run
from pipespec.engine.draft_tree import DraftTree


def test_a_trees_prediction_multiplies_along_each_path():
    by_rank = (0.7, 0.2)
    assert predicted(DraftTree.chain([5, 6, 7]), by_rank) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    # the root's two children, and a child under the first: 1 + 0.7 + 0.2 + 0.7 * 0.7
    assert predicted(DraftTree((5, 6, 7), (-1, -1, 0)), by_rank) == pytest.approx(1 + 0.7 + 0.2 + 0.49)
    assert best(3, by_rank) == pytest.approx(1 + 0.7 + 0.49 + 0.343)  # a chain beats 0.2 at the root
    assert best(4, by_rank) == pytest.approx(1 + 0.7 + 0.49 + 0.343 + 0.2401)
    assert best(2, (0.5, 0.4)) == pytest.approx(1 + 0.5 + 0.4)  # the runner-up beats 0.25 under the first


def test_measured_on_mocks_the_tokens_a_verification_commits_are_what_the_trees_predict():
    args = argparse.Namespace(agreement=0.6, runner_up=0.8, third=0.1, budgets=[5], branching=3, requests=12, tokens=48)
    (row,) = run(args)
    assert row["verifications"] > 100
    assert row["tree_tokens_per_verification"] == pytest.approx(row["tree_predicted"], rel=0.1)
    assert row["chain_tokens_per_verification"] == pytest.approx(row["chain_predicted"], rel=0.1)
    assert "| 5 |" in markdown([row], args)
