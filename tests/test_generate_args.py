"""Tests for pipespec/requests/generate_args.py: sequences are kept as tuples, `stop=None` is no stop strings,
the sampling values left as None take the config's defaults, and `checked()` gives plain Python
values or a ValueError naming the bad one (every way in, tests/test_bad_input.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pipespec import load_config
from pipespec.requests.generate_args import GenerateArgs


def test_sequences_are_kept_as_tuples():
    args = GenerateArgs(prompt_token_ids=[1, 2, 3], stop=["a", "b"])
    assert args.prompt_token_ids == (1, 2, 3) and args.stop == ("a", "b")
    assert args == GenerateArgs(prompt_token_ids=(1, 2, 3), stop=("a", "b"))
    assert GenerateArgs("hi", stop=None).stop == ()


def test_the_design_defaults():
    args = GenerateArgs()
    assert (args.prompt, args.prompt_token_ids, args.image, args.max_new_tokens, args.stop) == (None, None, None, 64, ())
    assert args.sampling() == {"temperature": None, "top_p": None, "top_k": None, "seed": None}


def test_unset_sampling_takes_the_configs_defaults():
    config = load_config(
        {"stages": [{"name": "t", "kind": "mock", "vocab_size": 16}], "sampling": {"temperature": 0.7, "top_p": 0.9}}
    )
    params = config.sampling.params(**GenerateArgs("hi", top_p=0.5, seed=4).sampling())
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.5, 0, 4)


def test_frozen():
    with pytest.raises(AttributeError):
        GenerateArgs("hi").prompt = "other"


def test_one_stop_string_may_be_given_as_a_string():
    assert GenerateArgs("hi", stop="END").stop == ("END",)


def test_checked_gives_plain_python_values():
    args = GenerateArgs(
        prompt_token_ids=np.array([3, 4]), max_new_tokens=np.int64(5), temperature=1, top_k=np.int32(2), seed=2**64 - 1
    )
    checked = args.checked()
    assert checked == GenerateArgs(prompt_token_ids=(3, 4), max_new_tokens=5, temperature=1.0, top_k=2, seed=2**64 - 1)
    assert [type(v) for v in (*checked.prompt_token_ids, checked.max_new_tokens, checked.temperature, checked.top_k)] == [
        int,
        int,
        int,
        float,
        int,
    ]
    assert GenerateArgs("hi").checked() == GenerateArgs("hi")  # None stays None: the config's default
    assert GenerateArgs("hi", max_new_tokens=None).checked().max_new_tokens is None  # as many as allowed (the front door)


@pytest.mark.parametrize(
    "args, message",
    [
        (GenerateArgs(), "no prompt: give prompt, messages or prompt_token_ids"),
        (GenerateArgs(" \n"), "the prompt is empty"),
        (GenerateArgs(prompt_token_ids=[]), "prompt_token_ids is empty"),
        (GenerateArgs(prompt_token_ids=5), "prompt_token_ids must be a sequence of token ids, got 5"),
        (GenerateArgs(prompt_token_ids=[1, True]), r"prompt_token_ids\[1\] must be a token id .* got True"),
        (GenerateArgs("hi", max_new_tokens=2**63), r"max_new_tokens must be a positive integer below 2\*\*63"),
        (GenerateArgs("hi", max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
        (GenerateArgs("hi", temperature=10**400), "temperature must be finite"),
        (GenerateArgs("hi", temperature=float("nan")), "temperature must be finite, got nan"),
        (GenerateArgs("hi", seed=-1), r"seed must be in \[0, 2\*\*64\), got -1"),
        (GenerateArgs("hi", seed=2**64), r"seed must be in \[0, 2\*\*64\)"),
        (GenerateArgs("hi", stop=("a", "")), r"stop\[1\] is empty"),
        (GenerateArgs("hi", stop=5), "stop must be a string or a list of strings, got 5"),
    ],
)
def test_checked_names_the_bad_value(args, message):
    with pytest.raises(ValueError, match=message):
        args.checked()


def test_a_huge_bad_value_is_named_not_printed():
    with pytest.raises(ValueError) as refused:
        GenerateArgs(prompt_token_ids="x" * 10**6).checked()
    assert len(str(refused.value)) < 200
