"""pipespec.engine.patience: when a verifier waits for drafts instead of generating a token itself."""

from __future__ import annotations

import pytest

from pipespec.engine.patience import Patience


def patience(verify_s: float, accepted: float = 1.0, rejected: float = 1.0, max_wait: float = 0.5) -> Patience:
    p = Patience(max_wait=max_wait)
    p.observe_forward(verify_s)
    p.accepted, p.rejected = accepted, rejected
    return p


def test_without_estimates_it_goes_now():
    assert Patience().wait_for(0, 4, 0.001) == (0, 0.0)
    assert patience(0.01).wait_for(0, 4, None) == (0, 0.0)


def test_a_full_window_goes_now():
    assert patience(0.01).wait_for(3, 3, 0.001) == (3, 0.0)


def test_a_slow_drafter_is_never_waited_for():
    """PipeSpec's rule: a drafter as slow as the verifier is not worth waiting for."""
    assert patience(0.01).wait_for(0, 4, 0.02) == (0, 0.0)


def test_a_fast_drafter_fills_the_window():
    want, seconds = patience(0.020, accepted=9, rejected=1).wait_for(0, 4, 0.001)
    assert want == 4
    assert seconds == pytest.approx(1.5 * 4 * 0.001)


def test_it_waits_for_what_it_can_afford_when_the_whole_window_costs_too_much():
    """Verifier 21 ms, drafter 5 ms per token, half a forward to spare: one draft (7.5 ms) is
    affordable and worth it, though the whole window of 3 (22.5 ms) is not affordable."""
    want, seconds = patience(0.021).wait_for(0, 3, 0.005)
    assert want == 1
    assert seconds == pytest.approx(0.0075)


@pytest.mark.parametrize("draft_s", [0.0, 0.0005, 0.002, 0.004, 0.008, 0.05])
@pytest.mark.parametrize("pending", [0, 1, 2])
def test_it_never_waits_longer_than_its_budget_nor_for_more_than_room(draft_s, pending):
    p = patience(0.012, accepted=5, rejected=2)
    want, seconds = p.wait_for(pending, 5, draft_s)
    assert pending <= want <= 5
    assert seconds <= p.max_wait * p.verify_s + 1e-12
    assert (seconds > 0) == (want > pending)


def test_low_acceptance_is_not_worth_waiting_for():
    """Drafts that are almost always rejected add nothing to a step: go now."""
    assert patience(0.020, accepted=0, rejected=50).wait_for(0, 4, 0.002) == (0, 0.0)


def test_by_default_it_waits_for_a_drafter_nearly_half_as_costly():
    """The demo's DREAM drafter on two cores: 7 ms a token beside a 17 ms target, 80% accepted. Waiting
    for a draft (1.8 tokens in 24 ms) beats stepping alone (1 token in 17 ms), and one forward of patience
    affords one (10.5 ms); half a forward (the old default) could not afford even one: it allows a drafter
    at most a third as costly."""
    want, seconds = patience(0.017, accepted=8.0, rejected=2.0, max_wait=Patience().max_wait).wait_for(0, 3, 0.007)
    assert want == 1
    assert seconds == pytest.approx(1.5 * 0.007)
    assert patience(0.017, accepted=8.0, rejected=2.0, max_wait=0.5).wait_for(0, 3, 0.007) == (0, 0.0)
