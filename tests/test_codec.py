"""Every pipeline message survives the wire (msgpack frames) exactly, tensors included; tensors on a
GPU are framed from the host and come back on the CPU (the CUDA test is marked `gpu`). A frame from a
peer (decoded with limits) that is malformed, of an unknown kind, mistyped or oversized is refused
with a FrameError naming the kind and the field."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from pipespec.config import LimitsSpec
from pipespec.protocol import codec
from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.messages import (
    Close,
    Closed,
    Commit,
    Draft,
    Failed,
    ImageInputs,
    Open,
    PrefillFeatures,
    RequestSpec,
    TargetFeatures,
    Verdict,
)
from pipespec.protocol.params import SamplingParams, VerifyMode
from pipespec.protocol.stats import PairStats, StageStats


def roundtrip(message):
    return codec.decode(codec.encode(message))


def test_plain_messages_roundtrip():
    spec = RequestSpec("r1", (1, 2, 3), SamplingParams(0.7, 0.9, 5, 42, VerifyMode.REJECTION), 32, frozenset({2, 7}))
    pair = PairStats("tiny", "target", 3, 9, 5, 2, [3, 2])
    for message in [
        Open(spec),
        Close("r1"),
        Verdict("r1", 4, 17, 99),
        Verdict("r1", 4, 17, 99, (5, 6)),
        Commit("r1", 5, (10, 11, 12)),
        Closed("r1", "target", StageStats("target", 3, 10, 1, 2, 0.5), pair),
        Failed("r1", "tiny", "RuntimeError: boom"),
        Draft("r1", 2, 8, (4, 5), None, 0.0012),
    ]:
        back = roundtrip(message)
        assert back == message and type(back) is type(message)
    assert roundtrip(Open(spec)).request.params.verify is VerifyMode.REJECTION
    assert roundtrip(Open(spec)).request.stop_token_ids == frozenset({2, 7})


def test_an_image_request_roundtrips_exactly():
    arrays = {
        "pixel_values": np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32),
        "image_grid_thw": np.array([[1, 4, 4]], dtype=np.int64),
        "pixel_attention_mask": np.ones((1, 1, 8, 8), dtype=bool),
    }
    spec = RequestSpec("r2", (1, 9, 9, 2), SamplingParams(), 8, image=ImageInputs(arrays), text_prompt_token_ids=(1, 2))
    back = roundtrip(Open(spec)).request
    assert back.text_prompt == (1, 2) and back.prompt_token_ids == (1, 9, 9, 2)
    for key, array in arrays.items():
        assert back.image.arrays[key].dtype == array.dtype
        np.testing.assert_array_equal(back.image.arrays[key], array)


def test_tensors_roundtrip_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        t = torch.randn(3, 50, generator=g).to(dtype)
        back = roundtrip(Draft("r", 0, 0, (1, 2, 3), t)).probs
        assert back.dtype == dtype and back.shape == t.shape
        assert torch.equal(
            back.view(torch.uint8) if dtype != torch.bfloat16 else back.view(torch.int16),
            t.view(torch.uint8) if dtype != torch.bfloat16 else t.view(torch.int16),
        )


def test_large_frames_stay_exact():
    t = torch.rand(8, 152_064, dtype=torch.float32)  # q rows of a Qwen-sized vocabulary: ~4.9 MB
    payload = codec.encode(Draft("r", 0, 0, tuple(range(8)), t))
    assert len(payload) > 4 * 2**20  # above gRPC's default 4 MiB limit: the transport must raise it
    assert torch.equal(codec.decode(payload).probs, t)


def tensor_messages(device: str) -> list:
    """Every message that carries tensors, its tensors on `device`: q rows, prefill features, step features."""
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(3, 40, generator=g, dtype=torch.float64), -1)
    hidden = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    mask = torch.tensor([True, True, False, False, False])
    prefill = PrefillFeatures(hidden.clone(), hidden, mask, torch.rand(5, generator=g))
    messages = [Draft("r", 1, 2, (4, 5, 6), probs), TargetFeatures("r", 0, prefill=prefill), TargetFeatures("r", 7, hidden[:2])]
    return [_to(m, device) for m in messages]


def _to(message, device: str):
    """`message` with its tensors moved to `device`."""
    if isinstance(message, torch.Tensor):
        return message.to(device)
    if dataclasses.is_dataclass(message):
        return dataclasses.replace(
            message, **{f.name: _to(getattr(message, f.name), device) for f in dataclasses.fields(message)}
        )
    return message


def assert_equal_on_cpu(back, sent) -> None:
    """`back` equals `sent` field by field, bit for bit, its tensors on the CPU."""
    if isinstance(sent, torch.Tensor):
        assert back.device.type == "cpu" and back.dtype == sent.dtype and torch.equal(back, sent.cpu())
    elif isinstance(sent, np.ndarray):
        assert back.dtype == sent.dtype
        np.testing.assert_array_equal(back, sent)
    elif isinstance(sent, dict):
        assert back.keys() == sent.keys()
        for key in sent:
            assert_equal_on_cpu(back[key], sent[key])
    elif dataclasses.is_dataclass(sent):
        assert type(back) is type(sent)
        for f in dataclasses.fields(sent):
            assert_equal_on_cpu(getattr(back, f.name), getattr(sent, f.name))
    else:
        assert back == sent


def test_features_and_q_rows_roundtrip():
    for message in tensor_messages("cpu"):
        assert_equal_on_cpu(roundtrip(message), message)


@pytest.mark.gpu
def test_cuda_tensors_cross_the_wire_and_arrive_on_the_cpu():
    for message in tensor_messages("cuda"):
        assert_equal_on_cpu(roundtrip(message), message)


# ---- frames from a peer: decode(payload, limits) ----------------------------------------------

LIMITS = LimitsSpec()


LOGPROBS_COMMIT = Commit(
    "r",
    5,
    (10, 11),
    (TokenLogprobs(10, -0.25, (10, 3), (-0.25, -1.5)), TokenLogprobs(11, -2.0, (4, 11, 7), (-0.5, -2.0, -float("inf")))),
)


def every_message() -> list:
    """One of every pipeline message kind, every field set, tensors and arrays included."""
    arrays = {"pixel_values": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "image_grid_thw": np.array([[1, 2, 2]])}
    image = RequestSpec("r2", (1, 9, 2), SamplingParams(0.5), 8, frozenset({2}), ImageInputs(arrays), (1, 2))
    return [
        Open(RequestSpec("r1", (1, 2, 3), SamplingParams(0.7, 0.9, 5, 42, VerifyMode.REJECTION), 32, frozenset({2, 7}))),
        Open(image),
        Close("r1"),
        Verdict("r1", 4, 17, 99),
        Commit("r1", 5, (10, 11, 12)),
        LOGPROBS_COMMIT,
        Closed("r1", "target", StageStats("target", 3, 10, 1, 2, 0.5), PairStats("tiny", "target", 3, 9, 5, 2, [3, 2])),
        Closed("r1", "tiny", StageStats("tiny"), None),
        Failed("r1", "tiny", "RuntimeError: boom"),
        Draft("r1", 2, 8, (4, 5), None, 0.0012),
        *tensor_messages("cpu"),
    ]


def test_every_message_roundtrips_exactly_from_a_peer():
    for message in every_message():
        payload = codec.encode(message)
        assert_equal_on_cpu(codec.decode(payload, LIMITS), message)
        assert_equal_on_cpu(codec.decode(payload, LIMITS), codec.decode(payload))  # the same as trusted decoding


def raw(message) -> dict:
    return msgpack.unpackb(codec.encode(message), raw=False)


def frame(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "payload, error",
    [
        (b"", "does not start as a pipeline message"),
        (b"\xc1", "does not start as a pipeline message"),
        (frame([1, 2]), "does not start as a pipeline message"),
        (frame({"request_id": "r", "__t": "Close"}), "its first key is 'request_id'"),
        (frame({"__t": 7}), "does not start with its message kind"),
        (codec.encode(Verdict("r", 1, 2, 3))[:-1], "a Verdict frame is not valid msgpack"),
        (codec.encode(Close("r")) + b"\x00", "a Close frame is not valid msgpack"),
        (frame({"__t": "Close", "request_id": "r", 1: 2}), "a Close frame is not valid msgpack"),
    ],
    ids=["empty", "reserved byte", "a list", "tag not first", "tag not a string", "truncated", "trailing bytes", "int key"],
)
def test_a_malformed_frame_is_refused(payload, error):
    with pytest.raises(codec.FrameError, match=error):
        codec.decode(payload, LIMITS)


@pytest.mark.parametrize(
    "payload, error",
    [
        (frame({"__t": "Bogus", "request_id": "r"}), "unknown kind 'Bogus'"),
        (frame({"__t": "RequestStats"}), "unknown kind 'RequestStats'"),  # a class of ours, but no pipeline message
        (frame({"__t": "SamplingParams"}), "unknown kind 'SamplingParams'"),
    ],
)
def test_an_unknown_kind_is_refused(payload, error):
    with pytest.raises(codec.FrameError, match=error):
        codec.decode(payload, LIMITS)


def tampered(message, path: str, value) -> bytes:
    """`message`'s frame with the field at dotted `path` set to `value` (raw msgpack), or removed if value is DELETE."""
    body = raw(message)
    *parents, last = path.split(".")
    node = body
    for name in parents:
        node = node[name]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return frame(body)


DELETE = object()
SPEC = Open(RequestSpec("r", (1, 2), SamplingParams(), 8, frozenset({2}), ImageInputs({"pixel_values": np.zeros(3, np.float32)})))
DRAFT = Draft("r", 0, 0, (1, 2), torch.zeros(2, 3), 0.5)
PREFILL = TargetFeatures("r", 0, prefill=PrefillFeatures(torch.zeros(2, 4), torch.zeros(2, 4), torch.tensor([True, False])))
CLOSED = Closed("r", "t", StageStats("t"), PairStats("d", "t", accepted_per_position=[1]))
TENSOR = {"__tensor": "float32", "shape": [2, 3], "data": bytes(24)}


@pytest.mark.parametrize(
    "message, path, value, error",
    [
        (Verdict("r", 1, 2, 3), "epoch", "1", r"Verdict\.epoch: expected int, got str '1'"),
        (Verdict("r", 1, 2, 3), "position", True, r"Verdict\.position: expected int, got bool"),
        (Verdict("r", 1, 2, 3), "token", 1.5, r"Verdict\.token: expected int, got float"),
        (Verdict("r", 1, 2, 3), "request_id", None, r"Verdict\.request_id: expected str, got NoneType"),
        (Verdict("r", 1, 2, 3, (4,)), "after", {"__tuple": [4, None]}, r"Verdict\.after\[1\]: expected int, got NoneType"),
        (Close("r"), "request_id", b"r", r"Close\.request_id: expected str, got bytes"),
        (DRAFT, "tokens", [1, 2], r"Draft\.tokens: expected tuple\[int, \.\.\.\], got list"),
        (DRAFT, "tokens", {"__tuple": [1, "x"]}, r"Draft\.tokens\[1\]: expected int, got str"),
        (DRAFT, "tokens", {"__fset": [1, 2]}, r"Draft\.tokens: expected tuple"),
        (DRAFT, "token_s", "fast", r"Draft\.token_s: expected float, got str"),
        (DRAFT, "probs", [0.5, 0.5], r"Draft\.probs: expected a torch tensor, got list"),
        (DRAFT, "probs", {"__ndarray": "<f4", "shape": [2, 3], "data": bytes(24)}, r"Draft\.probs: expected a torch tensor"),
        (DRAFT, "probs", {**TENSOR, "__tensor": "nn"}, r"Draft\.probs: a tensor of unknown dtype 'nn'"),
        (DRAFT, "probs", {**TENSOR, "data": bytes(23)}, r"Draft\.probs: shape \[2, 3\] takes 24 bytes, the data is 23"),
        (DRAFT, "probs", {**TENSOR, "shape": [-1]}, r"Draft\.probs: shape \[-1\] is not a list of sizes"),
        (DRAFT, "probs", {**TENSOR, "extra": 1}, r"Draft\.probs: expected a torch tensor"),
        (PREFILL, "prefill.image_mask", 1, r"TargetFeatures\.prefill\.image_mask: expected a torch tensor, got int"),
        (PREFILL, "prefill.hidden", DELETE, r"TargetFeatures\.prefill: missing field 'hidden'"),
        (
            PREFILL,
            "prefill",
            {"__t": "Close", "request_id": "r"},
            r"TargetFeatures\.prefill: expected PrefillFeatures, got a Close",
        ),
        (SPEC, "request.params.temperature", "hot", r"Open\.request\.params\.temperature: expected float, got str"),
        (SPEC, "request.params.temperature", -1.0, r"Open\.request\.params: temperature must be >= 0"),
        (
            SPEC,
            "request.params.verify",
            {"__e": "VerifyMode", "v": "bogus"},
            r"Open\.request\.params\.verify: 'bogus' is not a valid",
        ),
        (SPEC, "request.params.verify", {"__e": "Bogus", "v": "coupled"}, r"Open\.request\.params\.verify: expected VerifyMode"),
        (SPEC, "request.stop_token_ids", {"__tuple": [2]}, r"Open\.request\.stop_token_ids: expected frozenset\[int\]"),
        (SPEC, "request.max_new_tokens", 2**64 - 1, None),  # an int is an int, however large: the runner bounds it
        (SPEC, "request.image.arrays", [1], r"Open\.request\.image\.arrays: expected dict"),
        (
            SPEC,
            "request.image.arrays.pixel_values",
            {"__ndarray": "|O", "shape": [1], "data": bytes(8)},
            r"pixel_values'\]: an array of dtype '\|O'",
        ),
        (
            SPEC,
            "request.image.arrays.pixel_values",
            {"__ndarray": "<U2", "shape": [1], "data": bytes(8)},
            r"not a number or bool",
        ),
        (SPEC, "request.image.arrays.pixel_values", TENSOR, r"pixel_values'\]: expected a numpy array"),
        (
            SPEC,
            "request.image.arrays.pixel_values",
            {"__ndarray": "<f4", "shape": [4], "data": bytes(8)},
            r"takes 16 bytes, the data is 8",
        ),
        (CLOSED, "stage_stats", raw(PairStats("d", "t")), r"Closed\.stage_stats: expected StageStats, got a PairStats"),
        (CLOSED, "pair_stats.accepted_per_position", [1, "x"], r"Closed\.pair_stats\.accepted_per_position\[1\]: expected int"),
        (CLOSED, "stage_stats.compute_s", 1, None),  # an int is a float
        (Failed("r", "t", "boom"), "error", 5, r"Failed\.error: expected str, got int"),
        (Commit("r", 0, (1,)), "tokens", {"__tuple": [[1]]}, r"Commit\.tokens\[0\]: expected int, got list"),
        (Commit("r", 0, (1,)), "start", DELETE, r"Commit: missing field 'start'"),
        (Commit("r", 0, (1,)), "extra", 1, r"Commit: unknown field 'extra'"),
        (LOGPROBS_COMMIT, "logprobs", [], r"Commit\.logprobs: expected tuple\[.*TokenLogprobs.*\], got list"),
        (LOGPROBS_COMMIT, "logprobs.__tuple", [1], r"Commit\.logprobs\[0\]: expected TokenLogprobs, got int"),
        (LOGPROBS_COMMIT, "logprobs.__tuple", [raw(Close("r"))], r"Commit\.logprobs\[0\]: expected TokenLogprobs, got a Close"),
        (LOGPROBS_COMMIT, "logprobs", None, None),  # a request that asked for none
    ],
)
def test_a_mistyped_field_is_refused_naming_it(message, path, value, error):
    payload = tampered(message, path, value)
    if error is None:
        codec.decode(payload, LIMITS)
        return
    with pytest.raises(codec.FrameError, match=error):
        codec.decode(payload, LIMITS)


@pytest.mark.parametrize(
    "kind, bulky",
    [("Open", True), ("Draft", True), ("TargetFeatures", True)]
    + [(k, False) for k in ("Verdict", "Close", "Commit", "Closed", "Failed")],
)
def test_each_kind_has_its_frame_limit(kind, bulky):
    assert codec.frame_limit(kind, LIMITS) == (LIMITS.frame_bytes if bulky else codec.SMALL_FRAME_BYTES)


@pytest.mark.parametrize(
    "message",
    [
        Failed("r", "t", "x" * codec.SMALL_FRAME_BYTES),
        Commit("r", 0, tuple(range(2**20, 2**20 + 300_000))),
        Close("r" * codec.SMALL_FRAME_BYTES),
        Verdict("r" * codec.SMALL_FRAME_BYTES, 0, 0, 0),
        Closed("r", "t" * codec.SMALL_FRAME_BYTES, StageStats("t")),
    ],
    ids=lambda m: type(m).__name__,
)
def test_an_oversized_small_frame_is_refused(message):
    payload = codec.encode(message)
    kind = type(message).__name__
    with pytest.raises(codec.FrameError, match=f"a {kind} frame of {len(payload)} bytes is over the limit of {2**20} bytes"):
        codec.decode(payload, LIMITS)
    assert codec.decode(payload) == message  # trusted decoding has no limit


@pytest.mark.parametrize(
    "message",
    [Draft("r", 0, 0, (1, 2), torch.zeros(2, 1024)), TargetFeatures("r", 0, torch.zeros(4, 1024)), every_message()[1]],
    ids=lambda m: type(m).__name__,
)
def test_an_oversized_bulky_frame_is_refused(message):
    payload = codec.encode(message)
    kind = type(message).__name__
    assert codec.decode(payload, LimitsSpec(frame_bytes=len(payload))) is not None  # at the limit: taken
    with pytest.raises(codec.FrameError, match=f"a {kind} frame of {len(payload)} bytes is over the limit of {len(payload) - 1}"):
        codec.decode(payload, LimitsSpec(frame_bytes=len(payload) - 1))


def test_a_bulky_frame_may_be_larger_than_a_small_one():
    payload = codec.encode(Draft("r", 0, 0, tuple(range(8)), torch.rand(8, 50_000)))
    assert len(payload) > codec.SMALL_FRAME_BYTES
    assert codec.decode(payload, LIMITS).probs.shape == (8, 50_000)


def test_logprobs_cross_the_wire_in_a_small_frame_from_a_peer():
    tokens = tuple(range(100_000, 100_400))  # a long commit of a large vocabulary, 5 alternatives a token
    top = (-0.1234567890123, -1.5, -2.25, -float("inf"), -float("inf"))
    commit = Commit("r", 0, tokens, tuple(TokenLogprobs(t, -1.0 / (t - 99_999), tokens[:5], top) for t in tokens))
    payload = codec.encode(commit)
    assert len(payload) < codec.SMALL_FRAME_BYTES / 4
    assert codec.decode(payload, LIMITS) == commit  # floats exactly, -inf included
    body = raw(commit)
    body["logprobs"]["__tuple"][7]["top_ids"] = {"__tuple": [1, 2.5]}
    with pytest.raises(codec.FrameError, match=r"Commit\.logprobs\[7\]\.top_ids\[1\]: expected int, got float"):
        codec.decode(frame(body), LIMITS)
    body["logprobs"]["__tuple"][7]["top_ids"] = {"__tuple": [1]}
    body["logprobs"]["__tuple"][8]["logprob"] = "-1"
    with pytest.raises(codec.FrameError, match=r"Commit\.logprobs\[8\]\.logprob: expected float, got str"):
        codec.decode(frame(body), LIMITS)
