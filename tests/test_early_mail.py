"""EarlyMail holds the messages that overtook their request's Open, in order, within its bounds."""

from __future__ import annotations

import logging

from pipespec.engine.early_mail import EarlyMail
from pipespec.protocol.messages import Draft, Verdict


def test_messages_come_back_in_order_once():
    mail = EarlyMail("s")
    sent = [Draft("a", 0, 0, (1,)), Verdict("a", 0, 0, 2), Draft("a", 0, 1, (3,))]
    for m in sent:
        mail.hold("a", m)
    mail.hold("b", Verdict("b", 0, 0, 1))
    assert len(mail) == 4
    assert mail.release("a") == sent
    assert mail.release("a") == []
    assert len(mail) == 1


def test_a_request_holds_at_most_its_share(caplog):
    mail = EarlyMail("s", per_request=3, total=100)
    for i in range(5):
        mail.hold("a", Draft("a", 0, i, (i,)))
    assert [d.start for d in mail.release("a")] == [0, 1, 2]
    assert "over 3 messages came before its Open" in caplog.text
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_requests_that_never_open_are_forgotten_oldest_first(caplog):
    mail = EarlyMail("s", per_request=10, total=4)
    for rid in ["never1", "never1", "never2", "never3", "never3"]:  # 5 messages: never1's two are forgotten
        mail.hold(rid, Verdict(rid, 0, 0, 1))
    assert len(mail) == 3
    assert mail.release("never1") == []
    assert len(mail.release("never3")) == 2
    assert "dropped 2 messages for request never1: over 4 came before their Opens" in caplog.text
    for i in range(1000):  # a peer sending for ids that never open: memory stays bounded
        mail.hold(f"x{i}", Verdict(f"x{i}", 0, 0, 1))
    assert len(mail) == 4 and len(mail.held) == 4
