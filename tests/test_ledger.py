"""Tests for pipespec/serving/ledger.py: the ledger of committed prefixes accepts only commits that continue
the committed prefix exactly, and raises `LedgerError` on gaps, duplicates and double opens."""

import pytest

from pipespec.serving.ledger import Ledger, LedgerError


@pytest.fixture
def ledger():
    ledger = Ledger()
    ledger.open("r1")
    return ledger


def test_appends_in_order(ledger):
    ledger.append("r1", 0, (5, 6))
    ledger.append("r1", 2, (7,))
    ledger.append("r1", 3, ())
    ledger.append("r1", 3, (8, 9, 10))
    assert ledger.tokens("r1") == [5, 6, 7, 8, 9, 10]


def test_gap_raises(ledger):
    ledger.append("r1", 0, (1, 2))
    with pytest.raises(LedgerError, match=r"'r1': commit at 3 but 2 committed \(gap\)"):
        ledger.append("r1", 3, (4,))
    assert ledger.tokens("r1") == [1, 2]  # the bad commit changed nothing


def test_duplicate_raises(ledger):
    ledger.append("r1", 0, (1, 2))
    with pytest.raises(LedgerError, match=r"'r1': commit at 1 but 2 committed \(duplicate\)"):
        ledger.append("r1", 1, (2,))
    assert ledger.tokens("r1") == [1, 2]


def test_open_twice_raises(ledger):
    with pytest.raises(LedgerError, match=r"'r1' is already open"):
        ledger.open("r1")


def test_close_returns_tokens_and_forgets_the_request(ledger):
    ledger.append("r1", 0, (3, 1, 4))
    assert "r1" in ledger
    assert ledger.close("r1") == [3, 1, 4]
    assert "r1" not in ledger
    ledger.open("r1")  # a closed id can be opened again, empty
    assert ledger.tokens("r1") == []


def test_requests_are_independent(ledger):
    ledger.open("r2")
    ledger.append("r1", 0, (1,))
    ledger.append("r2", 0, (9, 9))
    ledger.append("r1", 1, (2,))
    assert ledger.close("r1") == [1, 2]
    assert ledger.close("r2") == [9, 9]


def test_ledger_error_is_a_runtime_error():
    assert issubclass(LedgerError, RuntimeError)
