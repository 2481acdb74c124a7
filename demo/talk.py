"""Questions that need no picture: the demo world's text-only conversations (kind "text").

A user's first message is often not about a picture: a greeting, a question about the world's shapes,
colours or numbers, or a picture question sent without the picture. The demo target learns these
beside the picture questions, so a text-only prompt gets a sensible sentence rather than whatever a
picture answer's first tokens lead to:

    no image   "Describe the image." (no picture)   "There is no image here. Send a picture with your question."
    sides      "How many corners does a square have?"  "A square has four corners."
    sums       "What is two plus three?"               "Two plus three is five."
    mixing     "What colour do blue and yellow make?"  "Blue and yellow make green."
    hello      "Hi! What can you do?"                  "Hello! I answer questions about pictures of shapes: ..."

`text_examples(split, n, seed)` gives `demo.world.Example`s with no scene; `score_text` checks an answer
against the example's truth. The splits partition the prompts by hash, as `demo.world` partitions scenes.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from demo.world import KINDS, Example, ask, random_scene

TEXT = "text"
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight")
_SIDES = {"triangle": 3, "square": 4, "diamond": 4, "circle": 0}
_MIXES = {("blue", "yellow"): "green", ("red", "yellow"): "orange", ("red", "blue"): "purple", ("black", "white"): "gray"}
NO_IMAGE, HELLO = "no image", "hello"
# A picture question without its picture most often.
_TOPICS = ("no_image", "no_image", "sides", "sums", "sums", "mixing", "hello")


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _no_image(rng: np.random.Generator) -> tuple[str, str, str]:
    prompt = ask(random_scene(rng, word=True), str(rng.choice(KINDS)), rng).prompt
    answer = _pick(
        rng,
        (
            "There is no image here. Send a picture with your question and I will answer it.",
            "I cannot see any picture in this conversation. Please send one with your question.",
            "No image was sent, so I cannot answer that. Add a picture and ask again.",
        ),
    )
    return prompt, answer, NO_IMAGE


def _sides(rng: np.random.Generator) -> tuple[str, str, str]:
    shape = _pick(rng, tuple(_SIDES))
    part = _pick(rng, ("sides", "corners"))
    prompt = _pick(
        rng, (f"How many {part} does a {shape} have?", f"How many {part} has a {shape}?", f"Count the {part} of a {shape}.")
    )
    n = _SIDES[shape]
    if n == 0:
        answer = _pick(rng, (f"A circle has no {part}: it is round.", f"None: a circle is round, so it has no {part}."))
    else:
        answer = _pick(rng, (f"A {shape} has {NUMBER_WORDS[n]} {part}.", f"It has {NUMBER_WORDS[n]} {part}."))
    return prompt, answer, NUMBER_WORDS[n]


def _sums(rng: np.random.Generator) -> tuple[str, str, str]:
    a, b = (int(x) for x in rng.integers(0, 5, size=2))
    words = rng.random() < 0.6
    x, y = (NUMBER_WORDS[a], NUMBER_WORDS[b]) if words else (str(a), str(b))
    prompt = _pick(rng, (f"What is {x} plus {y}?", f"What is {x} + {y}?", f"Add {x} and {y}.", f"How much is {x} and {y}?"))
    total = NUMBER_WORDS[a + b]
    answer = _pick(rng, (f"{NUMBER_WORDS[a].capitalize()} plus {NUMBER_WORDS[b]} is {total}.", f"The sum is {total}."))
    return prompt, answer, total


def _mixing(rng: np.random.Generator) -> tuple[str, str, str]:
    pair = list(_pick(rng, list(_MIXES)))  # type: ignore[arg-type]
    mix = _MIXES[tuple(pair)]  # type: ignore[index]
    if rng.random() < 0.5:
        pair.reverse()
    c, d = pair
    prompt = _pick(
        rng,
        (
            f"What colour do {c} and {d} make?",
            f"What do you get if you mix {c} and {d}?",
            f"Mix {c} with {d}: what colour is it?",
        ),
    )
    answer = _pick(rng, (f"{c.capitalize()} and {d} make {mix}.", f"Mixing {c} and {d} gives {mix}."))
    return prompt, answer, mix


def _hello(rng: np.random.Generator) -> tuple[str, str, str]:
    prompt = _pick(
        rng,
        (
            "Hello!", "Hi, who are you?", "What can you do?", "Hello, can you help me?", "Hi there.", "Good morning!",
            "Hey, what are you?", "Hi! Can you see pictures?", "Hello, what do you do?", "Who are you?", "Hey!",
            "What are you for?",
        ),
    )  # fmt: skip
    answer = _pick(
        rng,
        (
            "Hello! I answer questions about pictures of shapes: send one and ask me to describe it, count the "
            "shapes, name their colours and places, or read its word.",
            "Hi! I am a small vision-language model. Show me a picture of shapes and I can describe it, count "
            "them, say where they are and read the word in it.",
        ),
    )
    return prompt, answer, HELLO


_ASK = {"no_image": _no_image, "sides": _sides, "sums": _sums, "mixing": _mixing, "hello": _hello}


def _held_out(prompt: str) -> bool:
    """A quarter of all prompts are held out (by hash, so no held-out prompt is ever a training one)."""
    return hashlib.sha256(prompt.encode()).digest()[0] % 4 == 0


def text_examples(split: str, n: int, seed: int = 0) -> list[Example]:
    """`n` text-only examples of `split` ("train" or "held_out"), deterministic in `seed` (streams [seed, 2 + split])."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', not {split!r}")
    held_out = split == "held_out"
    rng = np.random.default_rng([seed, 2 + int(held_out)])
    out: list[Example] = []
    while len(out) < n:
        prompt, answer, truth = _ASK[_pick(rng, _TOPICS)](rng)
        if _held_out(prompt) == held_out:
            out.append(Example(None, TEXT, prompt, answer, truth))
    return out


_NUMBER_RE = re.compile(r"\b(" + "|".join(NUMBER_WORDS) + r"|none|no|\d)\b")
_COLOUR_RE = re.compile(r"\b(" + "|".join(sorted({*_MIXES.values(), *(c for pair in _MIXES for c in pair)})) + r")\b")
_NO_IMAGE_RE = re.compile(r"\b(no|not|cannot|can't|without)\b[^.]*\b(image|picture)\b")


def corpus(n: int, seed: int = 0) -> list[str]:
    """The prompts and answers of `n` training examples, for training a tokenizer (beside demo.world.corpus)."""
    return [text for ex in text_examples("train", n, seed) for text in (ex.prompt, ex.answer)]


def score_text(example: Example, answer_text: str) -> bool:
    """Does a text-only answer say its truth? A picture question without the picture: that there is no
    picture. A number: the last number said (digits too; "no"/"none" are zero). A colour: the last colour
    said. A greeting: an offer to look at a picture."""
    text = answer_text.lower()
    truth = example.truth
    if truth == NO_IMAGE:
        return _NO_IMAGE_RE.search(text) is not None
    if truth == HELLO:
        return "picture" in text
    if truth in NUMBER_WORDS:
        said = _NUMBER_RE.findall(text)
        value = {"none": "zero", "no": "zero", **{str(i): w for i, w in enumerate(NUMBER_WORDS)}}
        return bool(said) and value.get(said[-1], said[-1]) == truth
    said = _COLOUR_RE.findall(text)
    return bool(said) and said[-1] == truth
