"""Tests for pipespec/transport/generate_request.py: a request's `GenerateArgs` survive the trip
through the wire's `GenerateRequest`, every field, set or None; where proto3 cannot tell None from
empty, the documented mapping applies."""

from __future__ import annotations

import pytest

from pipespec.generate_args import SAMPLING_FIELDS, GenerateArgs
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


def test_absent_values_go_as_empty():
    request = to_proto(GenerateArgs(prompt_token_ids=(5, 6)))
    assert (request.prompt, request.image, list(request.stop)) == ("", b"", [])
    assert list(request.prompt_token_ids) == [5, 6] and request.max_new_tokens == 64


def test_what_the_wire_cannot_tell_apart():
    assert from_proto(to_proto(GenerateArgs("dropped", prompt_token_ids=(5,)))) == GenerateArgs(prompt_token_ids=(5,))
    assert from_proto(to_proto(GenerateArgs("hi", prompt_token_ids=()))).prompt_token_ids is None
    assert from_proto(to_proto(GenerateArgs("hi", image=b""))).image is None
    assert from_proto(to_proto(GenerateArgs())).prompt == ""  # no prompt at all: the front door refuses it


def test_an_unset_max_new_tokens_is_the_default():
    assert from_proto(pb.GenerateRequest(prompt="hi")) == GenerateArgs("hi")
