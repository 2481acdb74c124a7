"""Tests for pipespec/requests/frontdoor.py that need no model: `max_new_tokens=None` is as many tokens as the
limits and the target's context allow; a conversation's messages are charged at least CHARS_PER_TOKEN
characters each, so a flood of tiny messages is refused before it is rendered; `plain_text_ids`
tokenizes a text without the chat template after the same character check. (Every way in refusing
bad values alike: tests/test_bad_input.py.)
"""

from __future__ import annotations

import pytest

from pipespec import load_config
from pipespec.requests.frontdoor import CHARS_PER_TOKEN, FrontDoor, TargetInfo
from pipespec.requests.generate_args import GenerateArgs


class Tokenizer:
    """Counts what it is asked to do: one token a word, no chat template."""

    chat_template = None

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [1] * len(text.split())


def door(max_context: int | None = None, tokenizer: Tokenizer | None = None, **limits: int) -> FrontDoor:
    config = load_config({"stages": [{"name": "m", "kind": "mock", "vocab_size": 16}], "limits": limits})
    return FrontDoor(config, TargetInfo("m", "mock", 16, max_context, frozenset()), tokenizer)


def test_max_new_tokens_none_is_as_many_as_the_limits_and_the_context_allow():
    ids = (1, 2, 3)
    asked = GenerateArgs(prompt_token_ids=ids, max_new_tokens=None)
    assert door(None, max_new_tokens=100).request(asked)[0].max_new_tokens == 100
    assert door(40, max_new_tokens=100).request(asked)[0].max_new_tokens == 37  # the context's room
    assert door(40, max_new_tokens=20).request(asked)[0].max_new_tokens == 20
    with pytest.raises(ValueError, match=r"prompt of 3 tokens \+ 1 new token exceeds the context of 3 tokens of target 'm'"):
        door(3).request(asked)
    assert door(100).request(GenerateArgs(prompt_token_ids=ids))[0].max_new_tokens == 64  # the default stays


def test_each_message_is_charged_at_least_chars_per_token_before_rendering():
    tokenizer = Tokenizer()
    front = door(tokenizer=tokenizer, prompt_tokens=8)
    flood = [{"role": "user", "content": "x"}] * 9
    with pytest.raises(ValueError) as refused:
        front.request(GenerateArgs(messages=flood))
    assert str(refused.value).startswith(
        f"9 messages counted as {9 * CHARS_PER_TOKEN} characters (each at least {CHARS_PER_TOKEN}) are over "
        "limits.prompt_tokens (8)"
    )
    assert tokenizer.calls == 0  # never rendered
    spec, _ = front.request(GenerateArgs(messages=flood[:8], max_new_tokens=1))  # within the charge: rendered
    assert tokenizer.calls == 1 and len(spec.prompt_token_ids) == 8


def test_plain_text_is_checked_before_it_is_tokenized_without_a_template():
    tokenizer = Tokenizer()
    front = door(tokenizer=tokenizer, prompt_tokens=4)
    with pytest.raises(ValueError, match=rf"prompt of {4 * CHARS_PER_TOKEN + 1} characters is over limits.prompt_tokens \(4\)"):
        front.plain_text_ids("x" * (4 * CHARS_PER_TOKEN + 1))
    with pytest.raises(ValueError, match="the prompt is empty: give some text"):
        front.plain_text_ids("")
    assert tokenizer.calls == 0
    assert front.plain_text_ids("a b c") == [1, 1, 1]
    with pytest.raises(ValueError, match="no tokenizer"):
        door().plain_text_ids("abc")
