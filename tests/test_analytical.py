"""The throughput models of pipespec.planning.analytical: stages placed on devices, worked by hand."""

from __future__ import annotations

import pytest

from pipespec.planning.analytical import (
    PlacedChain,
    chain_rates,
    chain_rates_with_verify_cost,
    client_rate,
    device_loads,
    drafter_bound,
    expected_accepted,
    forward_latency,
    sync_rate,
    tokens_per_step,
)

# a 3-stage chain: 1-token and 8-token forwards (s), per-link alpha and window
ONE, BLOCK, ALPHAS, WINDOWS = [0.001, 0.004, 0.020], [0.0015, 0.005, 0.030], [0.7, 0.85], [3, 4]


@pytest.mark.parametrize("one, block", [(ONE, ONE), (ONE, BLOCK)], ids=["flat", "costly"])
def test_a_device_per_stage_is_the_chain_model(one, block):
    expected = chain_rates_with_verify_cost(one, block, 8, ALPHAS, WINDOWS)[-1]
    assert PlacedChain(one, block, 8, ALPHAS, WINDOWS, [0, 1, 2]).rate() == pytest.approx(expected, rel=1e-12)
    steps, _ = PlacedChain(one, block, 8, ALPHAS, WINDOWS, [0, 1, 2]).steps()
    loads = device_loads(steps, [0, 1, 2])
    assert loads[2] == pytest.approx(1 / expected)  # the target is busy all the time
    assert loads[0] <= loads[1] <= loads[2]  # a stage works at most as long as its verifier per token
    if one == block:
        assert expected == pytest.approx(chain_rates(one, ALPHAS, WINDOWS)[-1])


@pytest.mark.parametrize("alpha, window", [(0.6, 1), (0.75, 4), (0.9, 6)])
def test_a_drafter_and_its_target_on_one_device_is_synchronous_speculation(alpha, window):
    one, block = [0.002, 0.025], [0.003, 0.035]
    verify_s = forward_latency(one[1], block[1], 8, window + 1)
    expected = sync_rate(alpha, window, one[0], verify_s)
    assert PlacedChain(one, block, 8, [alpha], [window], ["cpu", "cpu"]).rate() == pytest.approx(expected, rel=1e-12)


def test_everything_on_one_device_sums_every_forward_per_token():
    """alpha 1: every draft is accepted and every step verifies (rho = 1), so the sums are exact.
    tiny 1 ms -> mid 4 ms (window 2: 3 tokens a step) -> target 20 ms (window 4: 5 tokens a step).
    Per committed token: the target steps 1/5 (4 ms), mid 4/15 (16/15 ms), tiny 8/15 (8/15 ms)."""
    one, alphas, windows = [0.001, 0.004, 0.020], [1.0, 1.0], [2, 4]
    per_token = 0.004 + 0.004 * 4 / 15 + 0.001 * 8 / 15  # 5.6 ms
    assert PlacedChain(one, one, 8, alphas, windows, [0, 0, 0]).rate() == pytest.approx(1 / per_token)
    nested = expected_accepted(1.0, 4) / (4 / sync_rate(1.0, 2, 0.001, 0.004) + 0.020)  # hierarchical sync
    assert 1 / per_token == pytest.approx(nested)


def test_stages_sharing_a_device_with_a_non_neighbour_are_bounded_by_that_device():
    """Same chain, tiny and the target on one device, mid on another: mid keeps up (the dependency bound
    is the chain model's 250 tok/s, 5 tokens per 20 ms), but the first device does the target's 4 ms and
    tiny's 8/15 ms per committed token."""
    one, alphas, windows = [0.001, 0.004, 0.020], [1.0, 1.0], [2, 4]
    _, rates = PlacedChain(one, one, 8, alphas, windows, ["a", "b", "a"]).steps()
    assert rates[-1] == pytest.approx(250.0)
    assert PlacedChain(one, one, 8, alphas, windows, ["a", "b", "a"]).rate() == pytest.approx(1 / (0.004 + 0.001 * 8 / 15))


def test_drafters_sharing_a_device_supply_at_their_synchronous_rate():
    """tiny + mid on one device: mid's sequence grows 3 tokens per 2 ms of tiny and 4 ms of its own,
    500 tokens a second: enough to fill the target's window of 4 in its 20 ms, so the target's rate is
    the chain model's; their device is busy 1.6 ms of every 4."""
    one, alphas, windows = [0.001, 0.004, 0.020], [1.0, 1.0], [2, 4]
    steps, rates = PlacedChain(one, one, 8, alphas, windows, [0, 0, 1]).steps()
    assert rates[1] == pytest.approx(500.0) and rates[2] == pytest.approx(250.0)
    assert device_loads(steps, [0, 0, 1]) == pytest.approx({0: 0.0016, 1: 0.004})
    assert PlacedChain(one, one, 8, alphas, windows, [0, 0, 1]).rate() == pytest.approx(250.0)


def test_a_drafter_supplies_one_forward_per_token_and_a_verdicts_lag_per_rejection():
    """A 7 ms drafter, alpha 0.8, a 16 ms verifier: 7 + 0.2 * 1.25 * 16 = 11 ms per committed token,
    91 tok/s. The chain formula alone says 2.29 drafts a step, 1.97 tokens a step: 123 tok/s."""
    assert drafter_bound(0.007, 0.8, 0.016) == pytest.approx(1 / 0.011)
    assert chain_rates([0.007, 0.016], [0.8], [3])[-1] == pytest.approx(1 / 0.011)
    assert drafter_bound(0.007, 1.0, 0.016) == pytest.approx(1 / 0.007)  # no rejection: its forwards alone


def test_a_rejection_a_branch_foresaw_costs_its_drafter_no_lag():
    """Half the rejections foreseen (pipespec.engine.outcome_cache): 7 + 0.5 * 0.2 * 1.25 * 16 = 9 ms a token;
    all foreseen: the drafter's forwards alone; only the pair whose branches they are gains."""
    assert drafter_bound(0.007, 0.8, 0.016, foreseen=0.5) == pytest.approx(1 / 0.009)
    assert drafter_bound(0.007, 0.8, 0.016, foreseen=1.0) == pytest.approx(1 / 0.007)
    assert chain_rates([0.007, 0.016], [0.8], [3], [0.5])[-1] == pytest.approx(1 / 0.009)
    three = [0.002, 0.007, 0.016], [0.8, 0.8], [3, 3]
    assert chain_rates(*three, [1.0])[1] > chain_rates(*three)[1]
    assert chain_rates(*three, [0.0, 0.5])[1] == chain_rates(*three)[1]


def test_the_drafter_bound_leaves_a_fast_drafter_and_a_slow_one_to_the_verifier():
    # a 1 ms drafter supplies 1 / (0.001 + 0.3 * 1.25 * 0.016) = 143 tok/s: the verifier's window binds first
    fast = chain_rates([0.001, 0.016], [0.7], [4])[-1]
    assert fast < drafter_bound(0.001, 0.7, 0.016)
    assert fast == pytest.approx(tokens_per_step(0.7, 4) / 0.016)  # n = min(4, 16) drafts: PipeSpec's E[N]
    assert fast == pytest.approx(chain_rates_with_verify_cost([0.001, 0.016], [0.001, 0.016], 8, [0.7], [4])[-1])
    # a drafter as slow as its verifier supplies less than the verifier makes alone: it generates alone
    assert drafter_bound(0.016, 0.5, 0.016) < 1 / 0.016
    assert chain_rates([0.016, 0.016], [0.5], [4])[-1] == pytest.approx(1 / 0.016)


def test_a_client_sees_each_requests_first_delta_then_the_decoding_rate():
    # 10 tokens: the first at 50 ms, 9 more at 100 tok/s (90 ms); 1 token: its first delta alone (20 ms)
    assert client_rate(100.0, [10, 1], [0.05, 0.02]) == pytest.approx(11 / (0.05 + 0.09 + 0.02))
    assert client_rate(100.0, [10], [0.0]) == pytest.approx(10 / 0.09)  # no prefill: the first token is free
