"""A peer's bad message never kills a stage runner (pipespec.engine.runner, pipespec.errors.ProtocolError).

Each case hands a forged message to one runner of a real in-process pipeline of mock stages, next to
the Open of one request (the "bad" one, its prompt starting with BAD): before it (the message
overtakes the Open and is replayed inside it) or right after it (before any real draft or verdict
could come). Either the bad request fails with an error naming the problem (its state may no
longer agree with its neighbours'), or it is unaffected and finishes equal to the target alone.
Either way the runner keeps running: the requests beside it, and one sent after it, are exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from pipespec import GenerationError, LocalPipeline
from pipespec.engine.runner import StageRunner
from pipespec.protocol.links import Inbox
from pipespec.protocol.messages import Close, Closed, Commit, Draft, Failed, Open, TargetFeatures, Verdict
from pipespec.protocol.stats import StageStats
from tests.test_runner import mock_config, requests

BAD = 13  # the bad request's first prompt token
BAD_REQUEST = dict(prompt_token_ids=[BAD, 2, 3], max_new_tokens=30)


def rid(o: Open) -> str:
    return o.request.request_id


@dataclass(frozen=True)
class Case:
    stage: str  # the runner that receives the forged messages: m0 (the drafter) or m1 (the target)
    around_open: Callable[[Open], list]  # the bad request's Open -> what that runner receives instead
    error: str | None  # the bad request fails with this (a regex); None: it is unaffected
    logged: str | None = None  # what the runner logs when it drops a message


CASES = {
    "a draft of a newer epoch, before its Open (replayed inside the Open)": Case(
        "m1",
        lambda o: [Draft(rid(o), 3, 0, (1,)), o],
        r"stage 'm1': ProtocolError: Draft for request .*: epoch 3 is newer than ours \(0\)",
    ),
    "a draft of a newer epoch": Case("m1", lambda o: [o, Draft(rid(o), 3, 0, (1,))], r"epoch 3 is newer than ours \(0\)"),
    "a draft leaving a gap": Case("m1", lambda o: [o, Draft(rid(o), 0, 5, (1,))], r"start 5 is not within 0\.\.0"),
    "a draft at a negative position": Case("m1", lambda o: [o, Draft(rid(o), 0, -1, (1,))], r"start -1 is not within 0\.\.0"),
    "a re-sent draft that differs": Case(
        "m1",
        lambda o: [o, Draft(rid(o), 0, 0, (1, 2)), Draft(rid(o), 0, 1, (3,))],
        r"tokens\[0\] = 3 at position 1, where it sent 2",
    ),
    "a draft to the first stage": Case(
        "m0", lambda o: [o, Draft(rid(o), 0, 0, (1,))], r"at stage 'm0': this stage has no drafter"
    ),
    "a verdict beyond our tokens": Case(
        "m0", lambda o: [o, Verdict(rid(o), 0, 5, 1)], r"Verdict .*: position 5 is not within 0\.\.0"
    ),
    "a verdict past max_new_tokens": Case(
        "m0", lambda o: [o, Verdict(rid(o), 0, 0, 1, (2,) * 30)], r"its tokens reach position 30, past max_new_tokens \(30\)"
    ),
    "a verdict going on after a stop token": Case(
        "m0",
        lambda o: [replace(o, request=replace(o.request, stop_token_ids=frozenset({7}))), Verdict(rid(o), 0, 0, 7, (4,))],
        r"its tokens go on after the stop token 7 at position 0",
    ),
    "a verdict at a negative position": Case("m0", lambda o: [o, Verdict(rid(o), 0, -1, 1)], r"position -1 is not within"),
    "a verdict beyond our tokens, before its Open": Case(
        "m0", lambda o: [Verdict(rid(o), 0, 5, 1), o], r"position 5 is not within"
    ),
    "features to a stage that reads none": Case(
        "m0", lambda o: [o, TargetFeatures(rid(o), 0, torch.zeros(1, 4))], r"at stage 'm0': this stage reads no target features"
    ),
    "a second Open": Case("m0", lambda o: [o, o], None, "already open"),
    "a second, different Open": Case("m1", lambda o: [o, Open(replace(o.request, max_new_tokens=3))], None, "already open"),
    "messages that name no request or a stage does not take": Case(
        "m1",
        lambda o: [
            o,
            Close(None),
            "junk",
            Commit(rid(o), 0, (1,)),
            Closed(rid(o), "m9", StageStats("m9")),
            Failed(rid(o), "m9", "forged"),
        ],
        None,
        "not a message a stage takes",
    ),
    "features for a request that never opens": Case("m1", lambda o: [o, TargetFeatures("nobody", 0, torch.zeros(1, 4))], None),
    "a stale draft and a pace that is no pace": Case(
        "m1",
        lambda o: [o, Draft(rid(o), -1, 0, (7, 7)), Draft(rid(o), 0, 0, (), None, float("nan"))],
        None,
        "token_s nan is no pace",
    ),
}


class Forger:
    """A link factory for LocalPipeline: in-process links, but the bad request's Open on its way to
    stage `case.stage` is replaced by what `case.around_open` makes of it."""

    def __init__(self, case: Case):
        self.case = case

    def __call__(self, peer: Inbox) -> ForgingLink:
        return ForgingLink(peer, self.case)


@dataclass
class ForgingLink:
    peer: Inbox
    case: Case

    def send(self, message) -> None:
        forge = (
            isinstance(message, Open)
            and isinstance(self.peer, StageRunner)
            and self.peer.name == self.case.stage
            and message.request.prompt_token_ids[0] == BAD
        )
        for m in self.case.around_open(message) if forge else [message]:
            self.peer.deliver(m)

    def send_all(self, messages) -> list:
        for message in messages:
            self.send(message)
        return []


@pytest.fixture(scope="module")
def target_alone():
    with LocalPipeline(mock_config([1.0])) as p:
        yield p


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_bad_message_fails_its_request_at_most(case, target_alone, caplog):
    with LocalPipeline(mock_config([0.7, 1.0]), link_factory=Forger(case)) as p:
        good = [p.submit(**r) for r in requests(4)]
        bad = p.submit(**BAD_REQUEST)
        if case.error is None:
            assert bad.result(timeout=30).token_ids == target_alone.generate(**BAD_REQUEST).token_ids
        else:
            with pytest.raises(GenerationError, match=case.error):
                bad.result(timeout=30)
        for fut, r in zip(good, requests(4)):
            assert fut.result(timeout=30).token_ids == target_alone.generate(**r).token_ids
        later = requests(5)[4]  # the runners still serve
        assert p.submit(**later).result(timeout=30).token_ids == target_alone.generate(**later).token_ids
        assert not any(task.done() for task in p._tasks)
    if case.logged is not None:
        assert any(case.logged in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
