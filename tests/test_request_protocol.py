"""pipespec.engine.request_protocol: one request's side of the protocol on its own, no runner, link or model.

Each test plays a stage's neighbours by hand: it hands the state machine drafts and verdicts, takes its
plans and answers them with decisions of its own choosing (as the stage's forward would), and reads what
it says to send, to whom."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipespec.engine.choice import Decision
from pipespec.engine.draft_tree import DraftTree
from pipespec.engine.patience import Patience
from pipespec.engine.request_protocol import Peer, RequestProtocol, Role, Surroundings
from pipespec.engine.step import Outcome, StepPlan
from pipespec.engine.trace import Timing
from pipespec.errors import ProtocolError
from pipespec.protocol.messages import Commit, Draft, RequestSpec, Siblings, Verdict
from pipespec.protocol.params import SamplingParams
from pipespec.protocol.tree_shape import TreeShape

PROMPT = (5, 6, 7)


@dataclass
class Session:
    """What the protocol reads of a session: the prompt's length and last token."""

    prompt_len: int = len(PROMPT)
    last_prompt_token: int = PROMPT[-1]
    prefill_features: object = None


def protocol(
    depth: int, drafter: bool, *, lookahead: int = 4, window: int = 2, max_new: int = 12, offers=None, tree=None, **around
) -> RequestProtocol:
    role = Role(
        "me", depth, lookahead, "up" if drafter else None, drafter_lookahead=4 if drafter else 0, verify_window=window,
        offers=offers, tree=tree,
    )  # fmt: skip
    shared = Surroundings(drafter=drafter, verifier=depth > 0, **around)
    p = RequestProtocol(role, shared, RequestSpec("r", PROMPT, SamplingParams(), max_new, frozenset({99})))
    p.prefilled(Session(), 0.001)
    return p


def answer(p: RequestProtocol, plan: StepPlan, accepted: int, own: int) -> None:
    """The forward of `plan` accepted its first `accepted` drafts and then decided `own`."""
    decision = Decision(accepted, (*plan.drafts[:accepted], own), None)
    p.finished(plan, Outcome((decision, None, ()), None, 0.0, Timing(0.0, 0.002, 0.002)))


def sent(p: RequestProtocol) -> list[tuple[Peer, object]]:
    out = [(peer, message) for peer, message, _ in p.sends]
    p.sends.clear()
    return out


def test_a_target_verifies_drafts_commits_what_it_accepted_and_answers_a_rejection():
    p = protocol(depth=0, drafter=True)
    p.on_draft(Draft("r", 0, 0, (1, 2, 3)))
    plan = p.plan(lambda: 0.0)
    assert (plan.keep, plan.feed, plan.start, plan.drafts) == (2, (7,), 0, (1, 2))  # the window: 2 of the 3
    answer(p, plan, accepted=2, own=4)  # both accepted, then its own 4 where the drafter has 3: a rejection
    assert sent(p) == [(Peer.DRAFTER, Verdict("r", 1, 2, 4)), (Peer.COORDINATOR, Commit("r", 0, (1, 2, 4)))]
    assert p.req.tokens == [1, 2, 4] and p.req.up.pending == [] and p.req.up.epoch == 1
    assert p.req.fed == len(PROMPT) + 2  # the accepted drafts' entries are valid; 4 is not fed yet
    # a draft of the old epoch is dropped on arrival, one of the new extends its pending drafts
    p.on_draft(Draft("r", 0, 3, (9,)))
    p.on_draft(Draft("r", 1, 3, (8,)))
    assert p.req.up.pending == [8] and p.req.stats.dropped_drafts == 1
    assert p.plan(lambda: 0.0).drafts == (8,)


def test_a_rejected_draft_starts_a_new_epoch_and_its_drafter_hears_the_token_that_replaced_it():
    p = protocol(depth=0, drafter=True, window=3)
    p.on_draft(Draft("r", 0, 0, (1, 2, 3)))
    plan = p.plan(lambda: 0.0)
    answer(p, plan, accepted=1, own=9)  # 1 accepted, 2 rejected: 9 in its place
    assert sent(p) == [(Peer.DRAFTER, Verdict("r", 1, 1, 9)), (Peer.COORDINATOR, Commit("r", 0, (1, 9)))]
    assert p.req.up.pending == [] and p.req.up.start == 2  # 3 was drafted after 2: gone with it
    assert (p.req.up.pair.num_drafts, p.req.up.pair.num_accepted_tokens) == (1, 1)


def test_a_drafter_drafts_to_its_bound_and_rolls_back_on_a_contradicting_verdict():
    p = protocol(depth=1, drafter=True, lookahead=2)  # a middle stage: it verifies "up" and drafts for "me"'s verifier
    for token in (1, 2):
        answer(p, p.plan(lambda: 0.0), 0, token)
    pace = p.around.token_s  # its seconds per token, told with its drafts
    assert sent(p) == [  # with no drafts to verify it generates alone, and tells its drafter each of its tokens
        (Peer.DRAFTER, Verdict("r", 0, 0, 1)), (Peer.VERIFIER, Draft("r", 0, 0, (1,), None, pace)),
        (Peer.DRAFTER, Verdict("r", 0, 1, 2)), (Peer.VERIFIER, Draft("r", 0, 1, (2,), None, pace)),
    ]  # fmt: skip
    assert p.plan(lambda: 0.0) is None  # two ahead of what its verifier confirmed: its lookahead
    p.on_verdict(Verdict("r", 0, 2, 3))  # all confirmed, and the verifier's own 3 after them
    assert p.req.tokens == [1, 2, 3] and p.req.down.verified == 3 and sent(p) == [(Peer.DRAFTER, Verdict("r", 0, 2, 3))]
    rev = p.req.rev
    p.on_verdict(Verdict("r", 1, 1, 7))  # the verifier took 7 at position 1: our 2 and 3 go
    assert p.req.tokens == [1, 7] and p.req.rev == rev + 1 and p.req.fed <= len(PROMPT) + 1
    assert sent(p) == [(Peer.DRAFTER, Verdict("r", 1, 1, 7))]  # our own drafter hears of it, in a new epoch of ours
    assert p.req.stats.rollbacks == 1


def test_a_step_computed_on_tokens_a_verdict_changed_is_dropped():
    p = protocol(depth=1, drafter=False, lookahead=4)
    answer(p, p.plan(lambda: 0.0), 0, 1)
    stale = p.plan(lambda: 0.0)
    p.launched(stale)
    p.on_verdict(Verdict("r", 1, 0, 5))  # while `stale` computes: the verifier's 5 at 0
    answer(p, stale, 0, 2)
    assert p.req.tokens == [5] and [m.tokens for _, m in sent(p)] == [(1,)]  # the first step's draft, nothing of `stale`


def test_a_verifier_waits_for_drafts_worth_waiting_for_and_wakes_when_the_wait_runs_out():
    patience = Patience()
    patience.observe_forward(0.010)  # its forward: 10 ms; the drafter's token: 1 ms
    p = protocol(depth=0, drafter=True, window=4, patience=patience, drafter_token_s=0.001)
    assert p.plan(lambda: 100.0) is None and p.wake_at is not None and 100.0 < p.wake_at <= 100.011
    p.on_draft(Draft("r", 0, 0, (1,)))
    assert p.plan(lambda: 100.001) is None  # one of the drafts it waits for
    plan = p.plan(lambda: p.wake_at)
    assert plan.drafts == (1,)  # the wait ran out: it verifies what it has
    p.launched(plan)
    assert p.req.up.wait_until is None


def test_a_verifier_whose_forwards_carry_other_requests_waits_for_no_drafts():
    patience = Patience()
    patience.observe_forward(0.010)  # as above: alone, it would wait
    p = protocol(depth=0, drafter=True, window=4, patience=patience, drafter_token_s=0.001)
    p.around.crowded = True  # its runner's forwards carry other requests stepping now (StageRunner.next_batch)
    p.on_draft(Draft("r", 0, 0, (1,)))
    plan = p.plan(lambda: 100.0)
    assert plan is not None and plan.drafts == (1,) and p.wake_at is None  # it goes now, with what it has


def test_without_its_drafter_a_verifier_steps_alone():
    p = protocol(depth=0, drafter=True)
    p.on_draft(Draft("r", 0, 0, (1, 2)))
    p.around.drafter = False
    p.drafter_lost()
    plan = p.plan(lambda: 0.0)
    assert plan.drafts == () and p.req.up.pending == []
    answer(p, plan, 0, 3)
    assert sent(p) == [(Peer.COORDINATOR, Commit("r", 0, (3,)))]  # no verdict: no drafter to tell


def test_a_relaying_middle_stage_passes_drafts_on_unchecked_and_its_drafter_hears_its_verifiers_rejection():
    p = protocol(depth=1, drafter=True, lookahead=3, relaying=True)  # load sheds its forwards (StageRunner.next_batch)
    p.on_draft(Draft("r", 0, 0, (1, 2, 3, 4)))
    assert p.req.tokens == [1, 2, 3] and p.req.up.pending == [4]  # its bound: 3 ahead of what its verifier confirmed
    assert sent(p) == [(Peer.DRAFTER, Verdict("r", 0, 2, 3)), (Peer.VERIFIER, Draft("r", 0, 0, (1, 2, 3), None, None))]
    assert p.plan(lambda: 0.0) is None and p.req.stats.forwards == 1  # no forward of its own (1: its prefill)
    p.on_verdict(Verdict("r", 1, 1, 7))  # the verifier took 7 at position 1: the drafter's 2, 3 and 4 go
    assert p.req.tokens == [1, 7] and p.req.up.pending == [] and sent(p) == [(Peer.DRAFTER, Verdict("r", 1, 1, 7))]
    p.around.drafter = False  # its drafter is lost: nothing to relay, it steps alone
    assert p.plan(lambda: 0.0).drafts == ()
    p.around.drafter = True
    p.on_draft(Draft("r", 1, 2, (5, 99, 6)))  # nothing past a stop token goes on
    assert p.req.tokens == [1, 7, 5, 99] and p.req.stats.relayed_drafts == 5
    assert sent(p) == [(Peer.DRAFTER, Verdict("r", 1, 3, 99)), (Peer.VERIFIER, Draft("r", 1, 2, (5, 99), None, None))]
    assert (p.req.up.pair.num_drafts, p.req.stats.rollbacks) == (0, 1)  # relayed drafts count as none verified


def test_a_forward_in_flight_when_relaying_starts_is_dropped_and_the_next_step_feeds_what_was_relayed():
    p = protocol(depth=1, drafter=True, lookahead=4)
    p.on_draft(Draft("r", 0, 0, (1, 2)))
    flight = p.launched(p.plan(lambda: 0.0))  # it verifies 1 and 2
    p.around.relaying = True
    p.on_draft(Draft("r", 0, 2, (3,)))
    assert p.req.tokens == [1, 2, 3]
    sent(p)
    answer(p, flight, 2, 9)  # its verdict came too late: our tokens grew past what it computed on
    assert p.req.tokens == [1, 2, 3] and not p.sends
    p.around.relaying = False  # load fell: it steps again, feeding the relayed tokens first
    plan = p.plan(lambda: 0.0)
    assert (plan.feed, plan.start, plan.drafts) == ((1, 2, 3), 3, ())  # the dropped forward fed the prompt's last


def test_a_stop_token_ends_the_request_and_a_rejoin_holds_its_committed_tokens():
    p = protocol(depth=0, drafter=False)
    answer(p, p.plan(lambda: 0.0), 0, 99)
    assert p.plan(lambda: 0.0) is None and sent(p) == [(Peer.COORDINATOR, Commit("r", 0, (99,)))]
    role = Role("me", 0, 4)
    rejoin = RequestProtocol(role, Surroundings(), RequestSpec("r", PROMPT, SamplingParams(), 12, committed=(1, 2)))
    rejoin.prefilled(Session(), 0.001)
    plan = rejoin.plan(lambda: 0.0)
    assert (plan.start, plan.feed) == (2, (7, 1, 2))  # it feeds the committed tokens in its first step


def test_a_target_checks_its_drafters_siblings_in_a_tree_and_a_path_off_the_line_rolls_the_drafter_back_there():
    tree = TreeShape(budget=5, branching=2)
    p = protocol(depth=0, drafter=True, window=3, tree=tree)
    offered = (Siblings(-0.1, (11,), (-2.0,)), Siblings(-0.2, (12,), (-1.0,)), Siblings(-0.3, (13,), (-3.0,)))
    p.on_draft(Draft("r", 0, 0, (1, 2, 3), siblings=offered))
    plan = p.plan(lambda: 0.0)
    # the line 1 2 3, then the best 2 siblings by value: 12 (under 1: -0.1 - 1.0) and 11 (under the root: -2.0)
    assert plan.tree == DraftTree((1, 2, 3, 12, 11), (-1, 0, 1, 0, -1)) and plan.rows == 1 + 5
    taken = Decision(2, (1, 12, 4), None, agreed=1)  # the target took 1, then the sibling 12, then its own 4
    p.finished(plan, Outcome((taken, None, ()), None, 0.0, Timing(0.0, 0.002, 0.002)))
    assert sent(p) == [(Peer.DRAFTER, Verdict("r", 1, 1, 12, (4,))), (Peer.COORDINATOR, Commit("r", 0, (1, 12, 4)))]
    assert p.req.fed == len(PROMPT) + 2  # the path's entries (1, 12) were kept in the cache; 4 is not fed yet
    assert p.req.up.pending == [] and p.req.up.pending_siblings == []
    pair = p.req.up.pair  # the path left the line: a rejection of the drafter's 2, though 2 tokens were accepted
    assert (pair.num_drafts, pair.num_draft_tokens, pair.num_nodes, pair.num_accepted_tokens, pair.num_rejections) == (
        1,
        3,
        5,
        2,
        1,
    )


def test_a_tree_is_checked_only_where_its_forward_fits_and_siblings_were_offered():
    tree = TreeShape(budget=5, branching=2)
    offered = tuple(Siblings(-0.1, (10 + i,), (-1.0,)) for i in range(3))
    rejoined = RequestProtocol(
        Role("me", 0, 4, "up", drafter_lookahead=4, verify_window=3, tree=tree),
        Surroundings(drafter=True),
        RequestSpec("r", PROMPT, SamplingParams(), 12, frozenset({99}), committed=(1, 2, 3, 4)),
    )
    rejoined.prefilled(Session(), 0.001)
    rejoined.on_draft(Draft("r", 0, 4, (5, 6, 7), siblings=offered))
    plan = rejoined.plan(lambda: 0.0)  # its first step feeds the prompt's last token and the 4 committed ones
    assert len(plan.feed) == 5 and plan.drafts == (5, 6, 7) and plan.tree is None  # 5 + 3 drafts fill budget + 1 rows
    p = protocol(depth=0, drafter=True, window=3, tree=tree)
    p.on_draft(Draft("r", 0, 0, (1, 2, 3), siblings=(Siblings(0.0),) * 3))  # values, no siblings (a relayed draft's)
    assert p.plan(lambda: 0.0).tree is None


def test_a_drafter_that_offers_trees_sends_its_tokens_siblings_and_forgets_those_a_verdict_replaced():
    tree = TreeShape(budget=5, branching=2)
    p = protocol(depth=1, drafter=False, lookahead=3, offers=tree)
    assert p.plan(lambda: 0.0).offers == tree
    for token, sib in ((1, Siblings(-0.1, (11,), (-2.0,))), (2, Siblings(-0.2, (12,), (-1.0,)))):
        plan = p.plan(lambda: 0.0)
        p.finished(plan, Outcome((Decision(0, (token,), None, siblings=(sib,)), None, ()), None, 0.0, Timing(0.0, 0.002, 0.002)))
    drafts = [m for _, m in sent(p)]
    assert [d.siblings for d in drafts] == [(Siblings(-0.1, (11,), (-2.0,)),), (Siblings(-0.2, (12,), (-1.0,)),)]
    p.on_verdict(Verdict("r", 1, 1, 12, (4,)))  # the verifier took 12 where we had 2, then its 4
    assert p.req.tokens == [1, 12, 4] and set(p.req.siblings) == {0}  # 2's siblings went with it
    p.sends.clear()
    p.finished(p.plan(lambda: 0.0), Outcome((Decision(0, (5,), None), None, ()), None, 0.0, Timing(0.0, 0.002, 0.002)))
    (draft,) = [m for _, m in sent(p)]
    assert draft.tokens == (5,) and draft.siblings == ()  # none known beside 5: none offered
    assert p.req.siblings == {}  # those the verifier confirmed, dropped


@pytest.mark.parametrize(
    "message, error",
    [
        (Draft("r", 3, 0, (1,), token_s=0.5), "epoch 3 is newer than ours"),
        (Draft("r", 0, 5, (1,)), r"start 5 is not within 0\.\.0"),
        (Verdict("r", 0, 4, 1), r"position 4 is not within 0\.\.0"),
        (Verdict("r", 0, 0, 99, (1,)), "go on after the stop token 99"),
    ],
)
def test_a_peers_violation_raises_before_it_changes_anything(message, error):
    p = protocol(depth=1, drafter=True)
    before = (list(p.req.tokens), p.req.rev, p.req.up.epoch, p.req.down.epoch, p.around.drafter_token_s)
    with pytest.raises(ProtocolError, match=error):
        (p.on_draft if isinstance(message, Draft) else p.on_verdict)(message)
    assert (list(p.req.tokens), p.req.rev, p.req.up.epoch, p.req.down.epoch, p.around.drafter_token_s) == before
    assert not p.sends


class Clock:
    """The runner's loop, as far as planning reads it: the time, and the wake-ups asked for."""

    def __init__(self, now: float):
        self.now, self.calls = now, []

    def time(self) -> float:
        return self.now

    def call_at(self, when, callback, *args):
        self.calls.append((when, callback, args))


def test_the_runner_wakes_a_waiting_request_when_its_wait_runs_out_and_tells_it_which_links_it_has():
    from pipespec.engine.runner import _WAKE, StageRunner
    from pipespec.protocol.links import InProcessLink

    patience = Patience()
    patience.observe_forward(0.010)
    runner = StageRunner(None, name="me", depth=0, max_lookahead=4, drafter_name="up", drafter_lookahead=4,
                         verify_window=4, patience=patience)  # fmt: skip
    try:
        assert (runner.around.drafter, runner.around.verifier) == (False, False)
        link = InProcessLink(None)
        runner.connect(upstream=link)
        assert runner.around.drafter and not runner.around.verifier
        runner.loop = Clock(100.0)
        p = RequestProtocol(runner.role, runner.around, RequestSpec("r", PROMPT, SamplingParams(), 12))
        p.prefilled(Session(), 0.001)
        runner.around.drafter_token_s = 0.001
        assert runner._plan(p) is None  # it waits for drafts worth waiting for ...
        [(when, callback, args)] = runner.loop.calls
        assert 100.0 < when <= 100.011 and callback == runner.deliver and args == (_WAKE,) and p.wake_at is None
        runner._on_lost(link)  # ... and without its drafter it never does
        assert not runner.around.drafter and runner.upstream is None
    finally:
        runner.scheduler.shutdown(wait=True)


class Planned:
    """A request whose next step is `plan` (what the runner asks of a request's protocol when it gathers a batch)."""

    def __init__(self, plan: StepPlan):
        self.step, self.wake_at, self.sends = plan, None, []
        self.ended = False

    def plan(self, clock):
        return self.step


class Batching:
    """A stage that batches (pipespec.engine.stage.BatchingStage), as far as the runner's gathering reads it."""

    name, vocab_size = "me", 50

    def open(self, request):
        raise AssertionError("not opened here")

    def forward_batch(self, feeds):
        raise AssertionError("not run here")

    def forward_rows(self, rows):
        return rows


@pytest.mark.parametrize("max_batch, expected", [(1, ["a"]), (3, ["b", "d", "a"]), (8, ["b", "d", "a", "c"])])
def test_a_batch_takes_the_most_urgent_steps_first_and_fills_its_slots_round_robin(max_batch, expected):
    from pipespec.engine.runner import StageRunner
    from pipespec.engine.scheduler import Priority

    runner = StageRunner(Batching(), name="me", depth=1, max_lookahead=4, drafter_name="up", max_batch=max_batch)
    try:
        for rid, drafts in (("a", ()), ("b", (1,)), ("c", ()), ("d", (2,))):  # a and c draft; b and d verify
            runner.requests[rid] = Planned(StepPlan(rid, 0, 0, 3, (7,), 0, drafts, None))
        batch = runner.next_batch()
        assert [plan.request_id for plan in batch.plans] == expected
        assert batch.priority is (Priority.DRAFT if max_batch == 1 else Priority.CHECK)
        assert runner.around.crowded is (max_batch > 1)  # several step in its forwards: none of them waits for drafts
        for rid in "bcd":
            del runner.requests[rid]
        runner.next_batch()
        assert not runner.around.crowded  # one alone may wait
    finally:
        runner.scheduler.shutdown(wait=True)


def test_a_middle_stage_relays_while_more_requests_than_its_relay_above_are_open():
    from pipespec.engine.runner import StageRunner

    runner = StageRunner(Batching(), name="me", depth=1, max_lookahead=4, drafter_name="up", max_batch=8, relay_above=2)
    try:
        for rid in "abc":
            runner.requests[rid] = Planned(StepPlan(rid, 0, 0, 3, (7,), 0, (), None))
        runner.next_batch()
        assert runner.around.relaying
        runner.requests["c"].ended = True  # its tokens end it: it waits only for its Close
        runner.next_batch()
        assert not runner.around.relaying  # two go on: each steps again
    finally:
        runner.scheduler.shutdown(wait=True)
