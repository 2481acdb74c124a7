"""Mock stages (pipespec/stages/mock.py): they agree with their verifier, and rank its token second where
they do not, at the configured rates."""

from __future__ import annotations

import math

import pytest
import torch

from pipespec import load_config
from pipespec.engine.stage import KVLengthError
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.stages.build import load_stages

N = 3000  # positions sampled per rate


def _pair(agreement: float, runner_up: float):
    drafter = {"name": "d", "kind": "mock", "agreement": agreement, "runner_up": runner_up, "vocab_size": 64}
    return load_stages(load_config({"stages": [drafter, {"name": "t", "kind": "mock", "vocab_size": 64}]}))


def _rows(stage) -> torch.Tensor:
    """[N, V] the stage's logits at N positions after varied token pairs."""
    return torch.stack([stage.row(i % 61, (7 * i) % 64, i) for i in range(N)])


def _within(count: int, p: float) -> bool:
    """count of N is a plausible Binomial(N, p) draw (5 standard deviations)."""
    return abs(count - N * p) <= 5 * math.sqrt(N * p * (1 - p)) + 1


@pytest.mark.parametrize("agreement, runner_up", [(0.8, 0.0), (0.6, 0.5), (0.7, 1.0)])
def test_a_mock_agrees_and_ranks_its_verifiers_token_second_at_the_configured_rates(agreement, runner_up):
    drafter, target = _pair(agreement, runner_up)
    ours, theirs = _rows(drafter), _rows(target)
    truth = theirs.argmax(-1)
    agreed = (ours == theirs).all(-1)
    assert _within(int(agreed.sum()), agreement)
    assert (ours.argmax(-1) == truth)[agreed].all()
    second = ours.topk(2, -1).indices[:, 1] == truth
    disagreed = int((~agreed).sum())
    # a random row ranks a given token first 1 time in 64 (then it stays first), second 1 time in 64
    expected = runner_up * 63 / 64 + (1 - runner_up) / 64
    assert abs(int(second[~agreed].sum()) - disagreed * expected) <= 5 * math.sqrt(disagreed * expected * (1 - expected)) + 1


def test_the_runner_up_rate_changes_no_agreement_and_no_verifier_logit():
    plain, plain_target = _pair(0.7, 0.0)
    betting, betting_target = _pair(0.7, 1.0)
    assert torch.equal(_rows(plain_target), _rows(betting_target))
    a, b = _rows(plain), _rows(betting)
    assert torch.equal((a == _rows(plain_target)).all(-1), (b == _rows(plain_target)).all(-1))
    assert torch.equal(a.argmax(-1), b.argmax(-1))  # only the second place moves


def test_a_tree_forward_gives_each_side_the_row_of_its_own_line_and_keeps_only_the_main_line():
    """forward_tree (pipespec.engine.stage.TreeSession): a side's row equals the last row of a session fed its
    whole line; the cache afterwards is what forward(keep, tokens) leaves; a side past `keep` is refused."""
    drafter, _ = _pair(0.6, 0.5)
    prompt = (5, 9, 2, 7)

    def opened():
        return drafter.open(RequestSpec("r", prompt, SamplingParams(), max_new_tokens=8))

    session = opened()
    session.forward(3, [7, 11, 12, 13])  # context: 5 9 2 7 11 12 13
    sides = [(1, (40, 41)), (5, (42,)), (0, (43,)), (6, (44, 45, 46))]
    main, rows = session.forward_tree(6, [20, 21], sides)
    plain = opened()
    plain.forward(3, [7, 11, 12, 13])
    assert torch.equal(main, plain.forward(6, [20, 21]))
    assert session.context == plain.context
    for (base, side), row in zip(sides, rows):
        line = [5, 9, 2, 7, 11, 12, 13][:base] + list(side)
        assert torch.equal(row, opened().forward(0, line)[-1]), (base, side)
    with pytest.raises(KVLengthError):
        session.forward_tree(2, [9], [(3, (1,))])
