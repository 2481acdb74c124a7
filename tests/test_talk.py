"""The demo world's questions that need no picture (demo/talk.py): examples, splits and scoring."""

from __future__ import annotations

import pytest

from demo import talk
from demo import world as w


@pytest.fixture(scope="module")
def train() -> list[w.Example]:
    return talk.text_examples("train", 600, seed=0)


@pytest.fixture(scope="module")
def held_out() -> list[w.Example]:
    return talk.text_examples("held_out", 300, seed=0)


def test_examples_are_seeded_and_the_splits_share_no_prompt(train, held_out):
    assert talk.text_examples("train", 600, seed=0) == train
    assert talk.text_examples("train", 50, seed=1) != train[:50]
    assert all(ex.scene is None and ex.kind == talk.TEXT for ex in train + held_out)
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in held_out}
    truths = {ex.truth for ex in train}
    assert {talk.NO_IMAGE, talk.HELLO, "green", "four", "zero"} <= truths  # every topic, the circle's "no corners" too
    assert {talk.NO_IMAGE, talk.HELLO} <= {ex.truth for ex in held_out}
    with pytest.raises(ValueError, match="'test'"):
        talk.text_examples("test", 3)


def test_a_picture_question_without_its_picture_is_asked_as_the_world_asks_it(train):
    picture_prompts = {ex.prompt for ex in w.examples("train", 3000, seed=0)}
    asked = [ex.prompt for ex in train if ex.truth == talk.NO_IMAGE]
    assert asked and sum(p in picture_prompts for p in asked) / len(asked) > 0.9


def test_every_answer_scores_and_the_wrong_ones_do_not(train, held_out):
    for ex in train + held_out:
        assert talk.score_text(ex, ex.answer), ex
        assert not talk.score_text(ex, "The circle is red."), ex  # a picture answer to a text question
        assert not talk.score_text(ex, "I do not know."), ex


@pytest.mark.parametrize(
    ("truth", "right", "wrong"),
    [
        ("four", "A square has four corners.", "A square has three corners."),
        ("zero", "A circle has no sides: it is round.", "A circle has one side."),
        ("five", "Two plus three is five.", "Two plus three is six."),
        ("five", "The sum is 5.", "The sum is 3."),
        ("green", "Blue and yellow make green.", "Blue and yellow make purple."),
        (talk.NO_IMAGE, "I cannot see a picture here.", "The picture shows a red circle."),
        (talk.HELLO, "Hello! Send me a picture and ask about it.", "Hello!"),
    ],
)
def test_the_scoring_rules(truth, right, wrong):
    ex = w.Example(None, talk.TEXT, "?", right, truth)
    assert talk.score_text(ex, right) and not talk.score_text(ex, wrong)


def test_the_tokenizer_corpus_holds_the_text_conversations():
    corpus = talk.corpus(100)
    assert len(corpus) == 200 and any("plus" in text for text in corpus) and any("no image" in text.lower() for text in corpus)
