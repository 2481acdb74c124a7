"""The generated visual world (demo/world.py): scenes, renders, examples, splits and scoring."""

from __future__ import annotations

import re

import numpy as np
import pytest

from demo import world as w


@pytest.fixture(scope="module")
def train() -> list[w.Example]:
    return w.examples("train", 300, seed=0)


@pytest.fixture(scope="module")
def held_out() -> list[w.Example]:
    return w.examples("held_out", 200, seed=0)


def test_render_is_deterministic_and_sized(train):
    for ex in train[:20]:
        for size in (64, 128):
            a, b = w.render(ex.scene, size), w.render(ex.scene, size)
            assert a.mode == "RGB" and a.size == (size, size)
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert w.render(train[0].scene).size == (w.IMAGE_SIZE, w.IMAGE_SIZE)


def test_shapes_are_drawn_in_their_cells(train):
    for ex in train[:60]:
        pixels = np.asarray(w.render(ex.scene, 64)).astype(int)
        for shape in ex.scene.shapes:
            row, col = divmod(w.CELLS.index(shape.cell), 3)
            centre = pixels[int((row + 0.5) * 64 / 3), int((col + 0.5) * 64 / 3)]
            assert np.abs(centre - np.array(w.COLOURS[shape.colour])).max() < 40, (shape, centre)
        if ex.scene.word is not None:
            row, col = divmod(w.CELLS.index(ex.scene.word.cell), 3)
            cell = pixels[row * 21 : (row + 1) * 21, col * 21 : (col + 1) * 21]
            ink = np.abs(cell - np.array(w.COLOURS[ex.scene.word.colour])).max(axis=-1) < 60
            assert ink.sum() >= 10  # the word leaves visible strokes


def test_scenes_are_well_formed(train, held_out):
    for ex in train + held_out:
        scene = ex.scene
        assert 1 <= len(scene.shapes) <= 4
        cells = [s.cell for s in scene.shapes] + ([scene.word.cell] if scene.word else [])
        assert len(set(cells)) == len(cells)
        assert len({s.name for s in scene.shapes}) == len(scene.shapes)
        assert all(s.colour != scene.background for s in scene.shapes)
        assert all(s.kind in w.KINDS_OF_SHAPE and s.size in w.SIZES and s.colour in w.COLOURS for s in scene.shapes)
        if scene.word is not None:
            assert scene.word.text in w.WORDS and scene.word.colour != scene.background


def test_examples_are_deterministic(train):
    assert w.examples("train", 300, seed=0) == train
    assert w.examples("train", 50, seed=1) != train[:50]
    assert w.examples("train", 7, seed=0) == train[:7]  # a prefix of a longer run


def test_splits_differ(train, held_out):
    triples = {(ex.prompt, ex.answer, ex.scene) for ex in train[:200]}
    assert not triples & {(ex.prompt, ex.answer, ex.scene) for ex in held_out[:200]}
    assert not {ex.scene for ex in train} & {ex.scene for ex in held_out}  # disjoint scenes by construction
    with pytest.raises(ValueError):
        w.examples("test", 3)


def test_every_kind_appears_roughly_equally(train):
    counts = {k: sum(ex.kind == k for ex in train) for k in w.KINDS}
    assert set(counts) == set(w.KINDS) and min(counts.values()) == max(counts.values()) == 50
    assert all(0 <= w.chance(k) < 1 for k in w.KINDS)


def test_read_only_with_words(train, held_out):
    reads = [ex for ex in train + held_out if ex.kind == "read"]
    assert reads and all(ex.scene.word is not None and ex.truth == ex.scene.word.text for ex in reads)


def test_answers_are_sentences(train):
    for ex in train:
        assert ex.answer.endswith(".") and ex.answer[0].isupper() and ex.prompt[0].isupper()
    describe = [len(ex.answer.split()) for ex in train if ex.kind == "describe"]
    assert min(describe) >= 12 and max(describe) >= 40


def _swap(text: str, old: str, new: str) -> str:
    out = re.sub(rf"\b{re.escape(old)}\b", new, text, flags=re.IGNORECASE)
    assert out != text, (text, old)
    return out


def _other(values, value):
    return next(v for v in values if v != value)


def _wrong(ex: w.Example) -> str:
    """The example's answer with its truth swapped for another value."""
    a, t = ex.answer, ex.truth
    if ex.kind == "count":
        m = re.search(r"\b(no|none|zero|one|two|three|four)\b", a, flags=re.IGNORECASE)
        return a[: m.start()] + _other(("two", "three"), t) + a[m.end() :]
    if ex.kind == "colour":
        return _swap(a, t, _other(w.COLOURS, t))
    if ex.kind == "where":
        for phrase in sorted(w._LOCATIONS[t], key=len, reverse=True):
            if phrase in a:
                return a.replace(phrase, w._LOCATIONS[_other(w.CELLS, t)][0])
        raise AssertionError(a)
    if ex.kind == "read":
        return _swap(a, t, _other(w.WORDS, t))
    if ex.kind == "describe":
        s = ex.scene.shapes[-1]
        taken = {x.name for x in ex.scene.shapes}
        colour = next(c for c in w.COLOURS if c != s.colour and f"{c} {s.kind}" not in taken)
        return a.replace(s.name, f"{colour} {s.kind}")
    if t in ("yes", "no"):
        return _swap(a, t, "no" if t == "yes" else "yes")
    if t in w.BACKGROUNDS:
        return _swap(a, t, _other(w.BACKGROUNDS, t))
    if t == "nothing":
        return "There is a small red circle there."
    colour, kind = t.split()
    return _swap(a, t, f"{_other(w.COLOURS, colour)} {kind}")


def test_score(train, held_out):
    for ex in train + held_out:
        assert w.score(ex, ex.answer), ex
        assert not w.score(ex, _wrong(ex)), (ex, _wrong(ex))
        assert not w.score(ex, "I do not know."), ex


def test_score_examples():
    scene = w.Scene(
        "gray",
        (w.Shape("circle", "red", "large", "top left"), w.Shape("star", "blue", "small", "center")),
        w.Word("cat", "bottom", "black"),
    )
    count = w.Example(scene, "count", "How many shapes are there?", "There are two shapes.", "two")
    assert w.score(count, "I can count 2 shapes.") and not w.score(count, "There are three shapes: two circles and a star.")
    where = w.Example(scene, "where", "Where is the star?", "It is in the center.", "center")
    assert w.score(where, "It is in the middle.") and not w.score(where, "It is at the top left.")
    top = w.Example(scene, "where", "Where is the red circle?", "It is in the top left corner.", "top left")
    assert not w.score(top, "It is at the top.") and not w.score(top, "It is on the left.")
    bg = w.Example(scene, "free", "What is the background colour?", "The background is gray.", "gray")
    assert not w.score(bg, "The background is light blue.")
    describe = w.Example(scene, "describe", "Describe the image.", "", "")
    assert w.score(describe, "There are two shapes: a large red circle and a small blue star.")
    assert not w.score(describe, "There are two shapes: a large red circle and a small green star.")
    assert not w.score(describe, "There are three shapes: a large red circle and a small blue star.")
    read = w.Example(scene, "read", "What word is written?", 'It says "cat".', "cat")
    assert w.score(read, "The word is cat.") and not w.score(read, 'It says "dog".')


def test_samples_and_corpus():
    triples = w.samples("held_out", 6, seed=3)
    exs = w.examples("held_out", 6, seed=3)
    assert [(p, kind) for _, p, kind in triples] == [(ex.prompt, ex.kind) for ex in exs]
    assert all(im.size == (w.IMAGE_SIZE, w.IMAGE_SIZE) and im.mode == "RGB" for im, _, _ in triples)
    text = w.corpus(30, seed=0)
    assert len(text) == 60 and all(isinstance(t, str) and t for t in text)


def test_the_world_s_own_descriptions_are_exact_and_altered_ones_are_not(train, held_out):
    describes = [ex for ex in train + held_out if ex.kind == "describe"]
    assert len(describes) > 50
    for ex in describes:
        assert w.describes_exactly(ex.scene, ex.answer), ex
        assert not w.describes_exactly(ex.scene, _wrong(ex)), ex
        s = ex.scene.shapes[0]
        other_size = "small" if s.size == "large" else "large"
        assert not w.describes_exactly(ex.scene, ex.answer.replace(s.full_name, f"{other_size} {s.name}")), ex
        assert not w.describes_exactly(ex.scene, ex.answer.replace(f"{ex.scene.background} background", "beige background")) or (
            ex.scene.background == "beige"
        )
        if ex.scene.word is not None:
            assert not w.describes_exactly(ex.scene, ex.answer.replace(f'"{ex.scene.word.text}"', '"zzz"')), ex


def test_describes_exactly_checks_each_shape_s_cell():
    scene = w.Scene("gray", (w.Shape("circle", "red", "large", "top left"), w.Shape("star", "blue", "small", "center")))
    right = "I can see two shapes on a gray background. A large red circle is in the top left corner. A small blue star is in the middle."
    assert w.describes_exactly(scene, right)
    assert not w.describes_exactly(scene, right.replace("top left corner", "top right corner"))
    assert not w.describes_exactly(scene, right + " There is a small green square at the bottom.")
    assert not w.describes_exactly(scene, right.replace("two shapes", "three shapes"))


def test_a_scene_s_truth_names_everything_in_it():
    scene = w.Scene("light blue", (w.Shape("square", "yellow", "large", "top right"),), w.Word("sky", "center", "black"))
    assert scene.truth() == 'light blue background; a large yellow square (top right); the word "sky" (center, black letters)'
