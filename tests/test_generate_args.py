"""Tests for pipespec/requests/generate_args.py: sequences are kept as tuples, `stop=None` is no stop strings,
the sampling values left as None take the config's defaults, `max_new_tokens=None` stays None (as many
as the limits allow) and left out is 64, and building one gives plain Python values or a ValueError
naming the bad one (every way in, tests/test_bad_input.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pipespec import load_config
from pipespec.requests.generate_args import DEFAULT_MAX_NEW_TOKENS, GenerateArgs


def test_sequences_are_kept_as_tuples():
    args = GenerateArgs(prompt_token_ids=[1, 2, 3], stop=["a", "b"])
    assert args.prompt_token_ids == (1, 2, 3) and args.stop == ("a", "b")
    assert args == GenerateArgs(prompt_token_ids=(1, 2, 3), stop=("a", "b"))
    assert GenerateArgs("hi", stop=None).stop == ()


def test_the_design_defaults():
    args = GenerateArgs("hi")
    assert (args.prompt_token_ids, args.image, args.max_new_tokens, args.stop) == (None, None, 64, ())
    assert args.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert args.sampling() == {"temperature": None, "top_p": None, "top_k": None, "seed": None}


def test_max_new_tokens_none_stays_none_its_one_meaning_is_the_front_doors():
    """None is kept as None (as many as the pipeline's limits allow: worked out by the front door,
    tests/test_frontdoor.py); only the keyword left out is the default."""
    assert GenerateArgs("hi", max_new_tokens=None).max_new_tokens is None
    assert GenerateArgs("hi").max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 64


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


def test_building_gives_plain_python_values():
    args = GenerateArgs(
        prompt_token_ids=np.array([3, 4]), max_new_tokens=np.int64(5), temperature=1, top_k=np.int32(2), seed=2**64 - 1
    )
    assert args == GenerateArgs(prompt_token_ids=(3, 4), max_new_tokens=5, temperature=1.0, top_k=2, seed=2**64 - 1)
    assert [type(v) for v in (*args.prompt_token_ids, args.max_new_tokens, args.temperature, args.top_k)] == [
        int,
        int,
        int,
        float,
        int,
    ]
    assert GenerateArgs("hi").temperature is None  # None stays None: the config's default


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "no prompt: give prompt, messages or prompt_token_ids"),
        (dict(prompt=" \n"), "the prompt is empty"),
        (dict(prompt_token_ids=[]), "prompt_token_ids is empty"),
        (dict(prompt_token_ids=5), "prompt_token_ids must be a sequence of token ids, got 5"),
        (dict(prompt_token_ids=[1, True]), r"prompt_token_ids\[1\] must be a token id .* got True"),
        (dict(prompt="hi", max_new_tokens=2**63), r"max_new_tokens must be a positive integer below 2\*\*63"),
        (dict(prompt="hi", max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
        (dict(prompt="hi", max_new_tokens="64"), "max_new_tokens must be a positive integer, got '64'"),
        (dict(prompt="hi", temperature=10**400), "temperature must be finite"),
        (dict(prompt="hi", temperature=float("nan")), "temperature must be finite, got nan"),
        (dict(prompt="hi", seed=-1), r"seed must be in \[0, 2\*\*64\), got -1"),
        (dict(prompt="hi", seed=2**64), r"seed must be in \[0, 2\*\*64\)"),
        (dict(prompt="hi", stop=("a", "")), r"stop\[1\] is empty"),
        (dict(prompt="hi", stop=5), "stop must be a string or a list of strings, got 5"),
    ],
)
def test_building_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerateArgs(**kwargs)


def test_no_args_hold_a_bad_value_a_replaced_one_is_checked_too():
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 0"):
        replace(GenerateArgs("hi"), max_new_tokens=0)


def test_a_huge_bad_value_is_named_not_printed():
    with pytest.raises(ValueError) as refused:
        GenerateArgs(prompt_token_ids="x" * 10**6)
    assert len(str(refused.value)) < 200
