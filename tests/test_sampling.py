"""Tests for pipespec/engine/sampling.py `log_processed` (temperature, then top-k, then top-p) and
`token_logprobs` (the logprobs a request gets), and for the validation and derived properties of
pipespec/protocol/params.py `SamplingParams`."""

import math

import pytest
import torch

from pipespec.engine.sampling import log_processed, token_logprobs
from pipespec.protocol.params import SamplingParams, VerifyMode

PROBS = [0.5, 0.3, 0.15, 0.05]


def kept(logp):
    """Number of tokens left with non-zero probability in each row."""
    return torch.isfinite(logp).sum(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scaling_matches_softmax(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logp = log_processed(logits, SamplingParams(temperature=temperature))
    assert logp.dtype == torch.float64 and logp.shape == (3, 50)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    torch.testing.assert_close(logp.exp(), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("k", [1, 2, 7, 49])
def test_top_k_keeps_exactly_k_tokens(k):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(k))
    logp = log_processed(logits, SamplingParams(temperature=1.0, top_k=k))
    assert kept(logp) == [k] * 4
    top = torch.topk(logits, k, dim=-1).indices
    assert torch.isfinite(logp.gather(-1, top)).all()  # the k kept are the k largest
    # the kept tokens keep their relative probabilities, renormalised
    expected = torch.softmax(logits.double().gather(-1, top), dim=-1)
    torch.testing.assert_close(logp.gather(-1, top).exp(), expected)


@pytest.mark.parametrize("k", [0, 50, 100])
def test_top_k_zero_or_at_least_vocab_is_off(k):
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    assert kept(log_processed(logits, SamplingParams(temperature=1.0, top_k=k))) == [50, 50]


# Logits as a model returns them (float32); probabilities [0.5, 0.3, 0.15, 0.05] in a shuffled order.
# (At an exact tie like top_p = 0.8 = 0.5 + 0.3, the answer depends on float rounding of the softmax;
# from float32 logits it is the mathematically expected one.)
@pytest.mark.parametrize(
    "top_p, expected",
    [(0.3, 1), (0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, expected):
    order = [2, 0, 3, 1]
    logits = torch.tensor([[math.log(PROBS[i]) for i in order]], dtype=torch.float32)
    logp = log_processed(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert kept(logp) == [expected]
    kept_ids = sorted(order.index(i) for i in range(expected))  # the `expected` most probable tokens
    assert torch.isfinite(logp[0, kept_ids]).all()
    torch.testing.assert_close(logp.exp().sum(dim=-1), torch.ones(1, dtype=torch.float64))


def test_top_p_applies_to_the_temperature_scaled_distribution():
    # logits = 2 log p at temperature 2 give back p: top_p 0.8 keeps 2, 0.81 keeps 3, as above.
    logits = torch.tensor([[2 * math.log(p) for p in PROBS]], dtype=torch.float32)
    assert kept(log_processed(logits, SamplingParams(temperature=2.0, top_p=0.8))) == [2]
    assert kept(log_processed(logits, SamplingParams(temperature=2.0, top_p=0.81))) == [3]


def test_top_k_then_top_p():
    logits = torch.tensor([[math.log(p) for p in PROBS]], dtype=torch.float32)
    # top_k = 2 leaves [0.625, 0.375]; top_p = 0.6 then keeps only the first.
    assert kept(log_processed(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))) == [1]
    # without top-k, 0.6 of the full distribution needs two tokens
    assert kept(log_processed(logits, SamplingParams(temperature=1.0, top_p=0.6))) == [2]


def test_top_p_works_row_by_row():
    flat = torch.zeros(1, 4)
    peaked = torch.tensor([[math.log(p) for p in PROBS]], dtype=torch.float32)
    logp = log_processed(torch.cat([flat, peaked]), SamplingParams(temperature=1.0, top_p=0.7))
    assert kept(logp) == [3, 2]


# --- token_logprobs ---------------------------------------------------------------------------


def test_greedy_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=3)  # top-k / top-p do not apply to greedy
    out = token_logprobs(logits, [7, 0, 49], params, 4)
    want = torch.log_softmax(logits.double(), dim=-1)
    for row, lp, token in zip(want, out, [7, 0, 49]):
        assert lp.token == token and lp.logprob == float(row[token])
        values, ids = torch.topk(row, 4)
        assert lp.top_ids == tuple(ids.tolist()) and lp.top_logprobs == tuple(values.tolist())
        assert type(lp.logprob) is float and all(type(v) is float for v in lp.top_logprobs)


def test_sampled_logprobs_are_those_of_the_processed_distribution():
    logits = torch.tensor([[math.log(p) for p in PROBS]], dtype=torch.float32)
    params = SamplingParams(temperature=1.0, top_k=2, seed=5)
    (lp,) = token_logprobs(logits, [1], params, 4)
    assert lp.logprob == float(log_processed(logits, params)[0, 1]) == pytest.approx(math.log(0.3 / 0.8))
    assert lp.top_ids == (0, 1, 2, 3) and lp.top_logprobs[2:] == (-math.inf, -math.inf)  # removed: -inf, ties to the lower id
    (removed,) = token_logprobs(logits, [3], params, 1)
    assert removed.logprob == -math.inf and removed.top_ids == (0,)


def test_no_alternatives_for_zero_and_ties_to_the_lower_id():
    logits = torch.zeros(2, 6)
    out = token_logprobs(logits, [4, 5], SamplingParams(), 0)
    assert [(lp.top_ids, lp.top_logprobs) for lp in out] == [((), ())] * 2
    assert all(lp.logprob == pytest.approx(-math.log(6)) for lp in out)
    assert token_logprobs(logits[:1], [4], SamplingParams(), 3)[0].top_ids == (0, 1, 2)
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        token_logprobs(logits[:1], [4], SamplingParams(), -1)


# --- SamplingParams ----------------------------------------------------------------------------


def test_sampling_params_defaults_are_greedy():
    params = SamplingParams()
    assert params.greedy and not params.rejection
    assert params.verify is VerifyMode.COUPLED


def test_rejection_property_needs_temperature():
    assert not SamplingParams(temperature=0.0, verify=VerifyMode.REJECTION).rejection
    assert SamplingParams(temperature=0.5, verify=VerifyMode.REJECTION).rejection
    assert not SamplingParams(temperature=0.5, verify=VerifyMode.COUPLED).rejection


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, r"temperature must be >= 0, got -0\.1"),
        ({"temperature": float("nan")}, r"temperature must be finite, got nan"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\], got 1\.01"),
        ({"top_p": -0.5}, r"top_p must be in \(0, 1\], got -0\.5"),
        ({"top_k": -1}, r"top_k must be >= 0, got -1"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
