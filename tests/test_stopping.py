"""Tests for pipespec/requests/stopping.py `StopRules`: max tokens, stop token ids and stop strings, with the
streamed text excluding the stop string and text that may begin a stop string held back until the
next token decides."""

import pytest

from pipespec.requests.stopping import StepOutcome, StopRules

EOS = 0
VOCAB = {
    EOS: "",  # special tokens decode to nothing
    1: "Hello",
    2: " wor",
    3: "ld",
    4: "ST",
    5: "OP",
    6: "Tx",
    7: "S",
    8: "TOP",
    9: " END",
    10: "Hello world",
}


class FakeDetokenizer:
    """Maps each id to a fixed string; never holds anything back."""

    def __init__(self):
        self.flushed = 0

    def push(self, token_id):
        return VOCAB[token_id]

    def flush(self):
        self.flushed += 1
        return ""


def make_rules(stop=(), max_new_tokens=100, stop_token_ids=frozenset({EOS}), detokenizer="fake"):
    detok = FakeDetokenizer() if detokenizer == "fake" else detokenizer
    return StopRules(max_new_tokens, frozenset(stop_token_ids), stop, detok)


def feed_all(rules, ids):
    """Feed ids until a finish reason; return (outcomes, streamed text)."""
    outcomes = []
    for token_id in ids:
        outcomes.append(rules.feed(token_id))
        if outcomes[-1].finish_reason is not None:
            break
    return outcomes, "".join(o.text for o in outcomes)


# --- without a detokenizer ----------------------------------------------------------------------


def test_max_new_tokens_finishes_with_length_exactly_at_the_count():
    rules = make_rules(max_new_tokens=3, detokenizer=None)
    assert rules.feed(11) == StepOutcome("", None)
    assert rules.feed(12) == StepOutcome("", None)
    assert rules.feed(13) == StepOutcome("", "length")
    assert rules.count == 3


def test_max_new_tokens_one():
    assert make_rules(max_new_tokens=1, detokenizer=None).feed(42).finish_reason == "length"


@pytest.mark.parametrize("stop_id", [2, 7])
def test_stop_token_id_finishes_with_stop(stop_id):
    rules = make_rules(max_new_tokens=10, stop_token_ids={2, 7}, detokenizer=None)
    assert rules.feed(5).finish_reason is None
    assert rules.feed(stop_id) == StepOutcome("", "stop")


def test_stop_token_wins_over_length_on_the_last_token():
    rules = make_rules(max_new_tokens=2, stop_token_ids={9}, detokenizer=None)
    rules.feed(1)
    assert rules.feed(9).finish_reason == "stop"


# --- with a detokenizer -------------------------------------------------------------------------


def test_plain_text_streams_token_by_token():
    outcomes, text = feed_all(make_rules(stop=["STOP"]), [1, 2, 3, EOS])
    assert [o.text for o in outcomes] == ["Hello", " wor", "ld", ""]
    assert outcomes[-1].finish_reason == "stop"
    assert text == "Hello world"


def test_eos_flushes_the_detokenizer():
    detok = FakeDetokenizer()
    rules = make_rules(detokenizer=detok)
    rules.feed(1)
    assert detok.flushed == 0
    rules.feed(EOS)
    assert detok.flushed == 1


def test_stop_string_spanning_two_tokens():
    rules = make_rules(stop=["STOP"])
    outcomes, text = feed_all(rules, [1, 4, 5, 1])
    assert len(outcomes) == 3  # finished on the token that completed "STOP"
    assert outcomes[1] == StepOutcome("", None)  # "ST" held back
    assert outcomes[2] == StepOutcome("", "stop")
    assert text == "Hello"
    assert rules.text == "Hello"


def test_possible_prefix_is_held_then_released():
    rules = make_rules(stop=["STOP"])
    assert rules.feed(1) == StepOutcome("Hello", None)
    assert rules.feed(4) == StepOutcome("", None)  # "ST" could begin "STOP"
    assert rules.held == "ST"
    assert rules.feed(6) == StepOutcome("STTx", None)  # "STTx" cannot: released
    assert rules.held == ""
    assert rules.text == "HelloSTTx"


def test_held_prefix_is_released_at_length_finish():
    outcomes, text = feed_all(make_rules(stop=["STOP"], max_new_tokens=2), [1, 4])
    assert outcomes[-1] == StepOutcome("ST", "length")
    assert text == "HelloST"


def test_held_prefix_is_released_at_eos():
    outcomes, text = feed_all(make_rules(stop=["STOP"]), [4, EOS])
    assert outcomes[-1] == StepOutcome("ST", "stop")
    assert text == "ST"


def test_overlapping_prefix_keeps_the_longest_candidate():
    # "ST" + "S" = "STS": "ST" is released, the trailing "S" may still begin "STOP", and it does.
    outcomes, text = feed_all(make_rules(stop=["STOP"]), [4, 7, 8, 1])
    assert [o.text for o in outcomes] == ["", "ST", ""]
    assert outcomes[-1].finish_reason == "stop"
    assert text == "ST"


@pytest.mark.parametrize(
    "ids, expected_text",
    [
        ([1, 9, 1], "Hello"),  # " END" completes the second stop string
        ([1, 4, 5, 9], "Hello"),  # "STOP" completes the first
        ([1, 2, 3, EOS], "Hello world"),  # neither
    ],
)
def test_several_stop_strings(ids, expected_text):
    outcomes, text = feed_all(make_rules(stop=["STOP", " END", ""]), ids)
    assert outcomes[-1].finish_reason == "stop"
    assert text == expected_text


def test_empty_stop_strings_are_ignored():
    rules = make_rules(stop=["", ""])
    assert rules.stop == ()
    assert rules.feed(1) == StepOutcome("Hello", None)


def test_earliest_stop_string_wins_when_one_piece_contains_two():
    outcomes, text = feed_all(make_rules(stop=["world", "lo"]), [10])
    assert outcomes[-1].finish_reason == "stop"
    assert text == "Hel"
