"""Tests for pipespec/transport/generate_request.py: a request's `GenerateArgs` survive the trip
through the wire's `GenerateRequest`, every field, set or None (`max_new_tokens` None is unset and
unset is None); a bad raw request is refused where it is read with the message LocalPipeline gives;
what the wire cannot carry is never built."""

from __future__ import annotations

import pytest

from pipespec.protos import pipespec_pb2 as pb
from pipespec.requests.generate_args import SAMPLING_FIELDS, GenerateArgs
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
    assert list(request.prompt_token_ids.ids) == [5, 6] and request.HasField("max_new_tokens") and request.max_new_tokens == 64


def test_max_new_tokens_none_is_unset_and_unset_is_none():
    """One meaning both ways: None (as many as the pipeline's limits allow) crosses as unset, and an
    unset field is read as None, not as the Python API's default."""
    assert not to_proto(GenerateArgs("hi", max_new_tokens=None)).HasField("max_new_tokens")
    assert from_proto(pb.GenerateRequest(prompt="hi")) == GenerateArgs("hi", max_new_tokens=None)
    assert from_proto(pb.GenerateRequest(prompt="hi", max_new_tokens=64)) == GenerateArgs("hi")


def test_an_empty_image_crosses_as_given():
    """What the front door refuses (pipespec.requests.images), the wire carries as the caller gave it."""
    args = GenerateArgs("hi", image=b"")
    assert from_proto(pb.GenerateRequest.FromString(to_proto(args).SerializeToString())) == args


def raw(**fields) -> pb.GenerateRequest:
    """A request as another client may send it: `prompt_token_ids` a list, the rest as the wire's fields."""
    ids = fields.pop("prompt_token_ids", None)
    return pb.GenerateRequest(**fields, **({} if ids is None else {"prompt_token_ids": pb.TokenIds(ids=ids)}))


BAD_ON_THE_WIRE = {  # a raw request, the same values given to GenerateArgs
    "prompt and token ids": dict(prompt="both", prompt_token_ids=[5]),
    "empty token ids": dict(prompt_token_ids=[]),
    "no prompt": {},
    "empty prompt": dict(prompt=""),
    "max_new_tokens 0": dict(prompt="hi", max_new_tokens=0),
    "max_new_tokens negative": dict(prompt="hi", max_new_tokens=-4),
    "temperature inf": dict(prompt="hi", temperature=float("inf")),
    "top_p 7": dict(prompt="hi", top_p=7.0),
    "top_k -3": dict(prompt="hi", top_k=-3),
    "empty stop string": dict(prompt="hi", stop=[""]),
    "logprobs 9": dict(prompt="hi", logprobs=9),
}


@pytest.mark.parametrize("fields", BAD_ON_THE_WIRE.values(), ids=BAD_ON_THE_WIRE.keys())
def test_a_bad_request_from_the_wire_is_refused_where_it_is_read_as_in_process(fields):
    """The wire carries what the front door must refuse; reading it builds the GenerateArgs, refused
    with the message LocalPipeline gives (the coordinator answers it as a refusal)."""
    request = pb.GenerateRequest.FromString(raw(**fields).SerializeToString())
    with pytest.raises(ValueError) as in_process:
        GenerateArgs(**fields)
    with pytest.raises(ValueError) as from_the_wire:
        from_proto(request)
    assert str(from_the_wire.value) == str(in_process.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt="hi", seed=2**70), "seed must be in"),
        (dict(prompt="hi", seed=-1), "seed must be in"),
        (dict(prompt="hi", max_new_tokens="64"), "max_new_tokens must be a positive integer"),
        (dict(prompt="hi", max_new_tokens=2**63), "max_new_tokens must be a positive integer below"),
        (dict(prompt="hi", top_k=2.5), "top_k must be an integer"),
        (dict(prompt="hi", top_k=True), "top_k must be an integer"),
        (dict(prompt="hi", temperature="hot"), "temperature must be a number"),
        (dict(prompt_token_ids=(1, 2**63)), r"prompt_token_ids\[1\] must be a token id"),
        (dict(prompt="\ud800"), "prompt is not valid text"),
        (dict(prompt="hi", stop=(5,)), r"stop\[0\] must be a string"),
    ],
)
def test_what_the_wire_cannot_carry_is_never_built(kwargs, message):
    """A GenerateArgs holds only what the wire carries: a value it could not carry is refused when it is built."""
    with pytest.raises(ValueError, match=f"^{message}"):
        GenerateArgs(**kwargs)


def test_an_image_not_yet_encoded_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match=r"^GenerateRequest\.image cannot carry 'cat\.png'"):
        to_proto(GenerateArgs("hi", image="cat.png"))
