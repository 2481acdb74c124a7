"""Tests for pipespec/generate_args.py: sequences are kept as tuples, `stop=None` is no stop strings,
and the sampling values left as None take the config's defaults."""

from __future__ import annotations

import pytest

from pipespec import load_config
from pipespec.generate_args import GenerateArgs


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
