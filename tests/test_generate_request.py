"""Tests for pipespec/transport/generate_request.py: a request's `GenerateArgs` survive the trip
through the wire's `GenerateRequest`, every field, set or None, empty or out of range (the front door
refuses those as LocalPipeline does); what the wire cannot carry at all is a ValueError naming the field."""

from __future__ import annotations

import pytest

from pipespec.requests.generate_args import SAMPLING_FIELDS, GenerateArgs
from pipespec.protos import pipespec_pb2 as pb
from pipespec.transport.generate_request import from_proto, to_proto

ROUND_TRIPS = {
    "text, defaults": GenerateArgs("Describe the image."),
    "token ids": GenerateArgs(prompt_token_ids=(1, 40, 50, 60)),
    "every field set": GenerateArgs(
        "Describe the image.",
        image=b"\x89PNG encoded bytes",
        max_new_tokens=17,
        temperature=0.5,  # exact in the wire's float32
        top_p=0.25,
        top_k=7,
        seed=2**40,  # the wire's seed is int64
        stop=("\n\n", "END"),
    ),
    "sampling set to zeros": GenerateArgs(prompt_token_ids=(3,), temperature=0.0, top_p=1.0, top_k=0, seed=0),
    "some sampling set": GenerateArgs("hi", temperature=0.75, seed=3),
}


@pytest.mark.parametrize("args", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_round_trip(args):
    wire = to_proto(args).SerializeToString()
    assert from_proto(pb.GenerateRequest.FromString(wire)) == args


def test_sampling_left_none_is_unset_on_the_wire():
    request = to_proto(GenerateArgs("hi"))
    assert not any(request.HasField(name) for name in SAMPLING_FIELDS)
    zeros = to_proto(GenerateArgs("hi", temperature=0.0, top_k=0, seed=0))
    assert zeros.HasField("temperature") and zeros.HasField("top_k") and zeros.HasField("seed")
    assert not zeros.HasField("top_p")


def test_absent_values_are_unset_on_the_wire():
    request = to_proto(GenerateArgs(prompt_token_ids=(5, 6)))
    assert not request.HasField("prompt") and not request.HasField("image") and list(request.stop) == []
    assert list(request.prompt_token_ids.ids) == [5, 6] and request.max_new_tokens == 64


AS_GIVEN = {
    "prompt and token ids": GenerateArgs("both", prompt_token_ids=(5,)),
    "empty token ids": GenerateArgs("hi", prompt_token_ids=()),
    "empty image": GenerateArgs("hi", image=b""),
    "no prompt": GenerateArgs(),
    "empty prompt": GenerateArgs(""),
    "max_new_tokens 0": GenerateArgs("hi", max_new_tokens=0),
    "out of range": GenerateArgs(
        "hi", max_new_tokens=2**40, temperature=float("inf"), top_p=7.0, top_k=-3, seed=2**64 - 1, stop=("",)
    ),
}


@pytest.mark.parametrize("args", AS_GIVEN.values(), ids=AS_GIVEN.keys())
def test_a_request_crosses_as_given(args):
    """Even what the front door will refuse: it must see it as the caller gave it, not as unset."""
    wire = to_proto(args).SerializeToString()
    assert from_proto(pb.GenerateRequest.FromString(wire)) == args


def test_an_unset_max_new_tokens_is_the_default():
    assert from_proto(pb.GenerateRequest(prompt="hi")) == GenerateArgs("hi")


@pytest.mark.parametrize(
    "args, field",
    [
        (GenerateArgs("hi", seed=2**70), "seed"),
        (GenerateArgs("hi", seed=-1), "seed"),
        (GenerateArgs("hi", max_new_tokens="64"), "max_new_tokens"),
        (GenerateArgs("hi", top_k=2.5), "top_k"),
        (GenerateArgs("hi", top_k=True), "top_k"),
        (GenerateArgs("hi", temperature="hot"), "temperature"),
        (GenerateArgs(prompt_token_ids=(1, 2**63)), "prompt_token_ids"),
        (GenerateArgs("\ud800"), "prompt"),
        (GenerateArgs("hi", stop=(5,)), "stop"),
    ],
)
def test_what_the_wire_cannot_carry_is_a_value_error_naming_the_field(args, field):
    with pytest.raises(ValueError, match=rf"^GenerateRequest\.{field} cannot carry"):
        to_proto(args)
