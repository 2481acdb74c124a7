"""Tests for pipespec/requests/tokenization.py: `check_shared_tokenizer` accepts stages that share a tokenizer
and rejects a mismatch (or a directory without one) with a ConfigError naming the stages and paths;
`IncrementalDetokenizer` streams exactly the text a full decode gives, non-ASCII included, and never a
partial character: a character split over byte tokens is held back until its last byte comes, under any
split and under sampled (random) ids, where a U+FFFD streams only for bytes nothing can complete."""

import random
import re

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pipespec.config import ConfigError, load_config
from pipespec.requests.tokenization import IncrementalDetokenizer, check_shared_tokenizer
from tests.fixtures.toy_models import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def tokenizer_dirs(tokenizer, tmp_path_factory):
    """Directories holding the shared tokenizer (twice), a different one, and nothing."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("shared_a", "shared_b", "other", "empty")}
    tokenizer.save_pretrained(dirs["shared_a"])
    tokenizer.save_pretrained(dirs["shared_b"])
    train_tokenizer(vocab_size=400).save_pretrained(dirs["other"])
    return {name: str(path) for name, path in dirs.items()}


def pipeline(*stages):
    """A config whose stages are (name, model directory) causal_lm stages; only tokenizers matter."""
    return load_config({"stages": [{"name": name, "kind": "causal_lm", "model": model} for name, model in stages]})


def test_shared_tokenizer_passes_and_is_returned(tokenizer, tokenizer_dirs):
    config = pipeline(("drafter", tokenizer_dirs["shared_a"]), ("target", tokenizer_dirs["shared_b"]))
    shared = check_shared_tokenizer(config)
    assert shared is not None
    assert shared.get_vocab() == tokenizer.get_vocab()
    assert shared.encode("the red circle") == tokenizer.encode("the red circle")


def test_ngram_stage_needs_no_tokenizer(tokenizer, tokenizer_dirs):
    config = load_config(
        {
            "stages": [
                {"name": "lookup", "kind": "ngram"},
                {"name": "target", "kind": "causal_lm", "model": tokenizer_dirs["shared_a"]},
            ]
        }
    )
    assert check_shared_tokenizer(config).get_vocab() == tokenizer.get_vocab()


def test_mock_pipeline_has_no_tokenizer():
    config = load_config({"stages": [{"name": "a", "kind": "mock"}, {"name": "b", "kind": "mock"}]})
    assert check_shared_tokenizer(config) is None


def test_different_tokenizers_name_both_stages_and_paths(tokenizer_dirs):
    other, shared = tokenizer_dirs["other"], tokenizer_dirs["shared_a"]
    config = pipeline(("tiny", other), ("big", shared))
    with pytest.raises(ConfigError) as excinfo:
        check_shared_tokenizer(config)
    message = str(excinfo.value)
    assert re.search(rf"stages\[0\] \(tiny\): tokenizer of '{re.escape(other)}' \(400 tokens\)", message)
    assert re.search(rf"stage 'big' at '{re.escape(shared)}' \(512 tokens\)", message)


def test_mismatch_in_the_middle_of_three_stages(tokenizer_dirs):
    config = pipeline(("tiny", tokenizer_dirs["shared_a"]), ("mid", tokenizer_dirs["other"]), ("big", tokenizer_dirs["shared_b"]))
    with pytest.raises(ConfigError, match=r"stages\[1\] \(mid\).*stage 'big'"):
        check_shared_tokenizer(config)


def test_directory_without_tokenizer_files(tokenizer_dirs):
    empty = tokenizer_dirs["empty"]
    config = pipeline(("drafter", tokenizer_dirs["shared_a"]), ("target", empty))
    with pytest.raises(ConfigError, match=rf"stages\[1\] \(target\): cannot load a tokenizer from '{re.escape(empty)}'"):
        check_shared_tokenizer(config)


# --- IncrementalDetokenizer ---------------------------------------------------------------------


def stream(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize(
    "text",
    [
        "the red circle is next to a blue square.",
        "café ünïcode ✓",
        "日本語 😀 emoji ✓✓✓",
        "a  b   c\n\nd\t",
        " leading and trailing space ",
        "",
    ],
)
def test_incremental_detokenizer_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, rest = stream(tokenizer, ids)
    assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in piece for piece in pieces)  # incomplete UTF-8 is held back, not streamed


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    ids = [tokenizer.bos_token_id, *tokenizer.encode("one two ✓"), tokenizer.eos_token_id]
    pieces, rest = stream(tokenizer, ids)
    assert "".join(pieces) + rest == "one two ✓"


def byte_tokens(tokenizer, data: bytes) -> list[int]:
    """`data` as one byte-level token per byte (GPT-2's byte alphabet, which the toy tokenizer holds whole)."""
    alphabet = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([alphabet[b] for b in data])


def check_stream(tokenizer, ids: list[int]) -> list[str]:
    """Push `ids` one at a time; after each, the text streamed so far must be a prefix of the decode of
    the ids so far (nothing streamed is ever revised), and all of it with `flush` the full decode.
    -> the pieces, `flush`'s last."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces: list[str] = []
    for k, token in enumerate(ids, 1):
        pieces.append(detok.push(token))
        so_far = tokenizer.decode(ids[:k], skip_special_tokens=True)
        assert so_far.startswith("".join(pieces)), (ids[:k], pieces, so_far)
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids
    return pieces


MULTI_BYTE = ["é", "ü", "ñ", "✓", "日", "本", "語", "中", "😀", "🎉", "👍🏽", "ß", "€", " ", "a", "."]


@pytest.mark.parametrize("text", ["café", "naïve ✓ done", "日本語 and 中文", "emoji 😀🎉 end", "👍🏽 ok"])
def test_characters_split_into_byte_tokens_are_held_back_until_complete(tokenizer, text):
    ids = byte_tokens(tokenizer, text.encode())
    pieces = check_stream(tokenizer, ids)
    assert [piece for piece in pieces if piece] == list(text)  # each character once its last byte is in, whole


def test_sampled_splits_of_multi_byte_text_never_stream_a_partial_character(tokenizer):
    """Valid text cut into tokens at random byte offsets (merged tokens where the vocabulary has them,
    single bytes elsewhere), as a sampled stream of a byte-level BPE model cuts it."""
    rng = random.Random(7)
    for _ in range(200):
        text = "".join(rng.choice(MULTI_BYTE) for _ in range(rng.randrange(1, 12)))
        data, ids = text.encode(), []
        while data:
            cut = rng.randrange(1, min(len(data), 5) + 1)
            chunk, data = data[:cut], data[cut:]
            try:
                merged = tokenizer.encode(chunk.decode())  # a whole piece of text: the vocabulary's merges
            except UnicodeDecodeError:  # a cut through a character: its bytes one token each
                merged = byte_tokens(tokenizer, chunk)
            ids.extend(merged)
        pieces = check_stream(tokenizer, ids)
        assert "".join(pieces) == text
        assert not any("\ufffd" in piece for piece in pieces), (text, pieces)


def test_a_character_begun_and_abandoned_streams_once_nothing_can_complete_it(tokenizer):
    """A sampled model may emit an emoji's first bytes, then " four": held while the next token could
    complete them; then the decode's U+FFFD, which no token can take back."""
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(t) for t in byte_tokens(tokenizer, "😀".encode()[:2])] == ["", ""]
    four = tokenizer.encode(" four")
    assert (
        "".join(detok.push(t) for t in four)
        == "\ufffd four"
        == tokenizer.decode([*byte_tokens(tokenizer, "😀".encode()[:2]), *four])
    )
    assert detok.flush() == ""


def test_a_character_cut_by_the_end_of_the_stream_is_flushed(tokenizer):
    ids = [*tokenizer.encode("ok "), *byte_tokens(tokenizer, "日".encode()[:2])]
    pieces = check_stream(tokenizer, ids)
    assert "".join(pieces[:-1]) == "ok " and pieces[-1] == tokenizer.decode(ids)[len("ok ") :] == "\ufffd"


def test_incremental_detokenizer_on_random_ids(tokenizer):
    # Arbitrary id sequences, including byte tokens that do not form valid UTF-8 (most of them bytes:
    # characters begun, continued and abandoned).
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(1, 16)
        ids = [rng.randrange(len(tokenizer)) if rng.random() < 0.5 else rng.randrange(3, 259) for _ in range(n)]
        check_stream(tokenizer, ids)
