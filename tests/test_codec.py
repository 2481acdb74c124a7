"""Every pipeline message survives the wire (msgpack frames) exactly, tensors included; tensors on a
GPU are framed from the host and come back on the CPU (the CUDA test is marked `gpu`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipespec import codec
from pipespec.messages import (
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
from pipespec.params import SamplingParams, VerifyMode
from pipespec.stats import PairStats, StageStats


def roundtrip(message):
    return codec.decode(codec.encode(message))


def test_plain_messages_roundtrip():
    spec = RequestSpec("r1", (1, 2, 3), SamplingParams(0.7, 0.9, 5, 42, VerifyMode.REJECTION), 32, frozenset({2, 7}))
    pair = PairStats("tiny", "target", 3, 9, 5, 2, [3, 2])
    for message in [
        Open(spec),
        Close("r1"),
        Verdict("r1", 4, 17, 99),
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
