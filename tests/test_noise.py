"""Tests for pipespec/engine/noise.py: the counter-based hash gives the same integers on Python ints, int64
tensors (so on any device) and uint32 arrays (the CPU's), and the uniforms and Gumbel noise built on it are
deterministic, keyed by (seed, position, stream, index), and correctly distributed."""

import random

import numpy as np
import pytest
import torch

from pipespec.engine import noise

M32 = 0xFFFFFFFF
EULER_GAMMA = 0.5772156649015329


def lowbias32_reference(x):
    """Chris Wellons' lowbias32 written with plain Python big-int multiplications."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def random_words(n, seed=0):
    rng = random.Random(seed)
    return [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, M32] + [rng.getrandbits(32) for _ in range(n)]


def test_mix32_on_ints_equals_mix32_on_int64_tensor():
    words = random_words(5000)
    from_ints = [noise.mix32(x) for x in words]
    from_tensor = noise.mix32(torch.tensor(words, dtype=torch.int64)).tolist()
    assert from_ints == from_tensor
    assert all(0 <= h <= M32 for h in from_ints)


def test_mix32_on_uint32_arrays_equals_mix32_on_ints():
    words = random_words(5000, seed=2)
    assert noise.mix32(np.array(words, dtype=np.uint32)).tolist() == [noise.mix32(x) for x in words]


@pytest.mark.parametrize("rows, num", [(1, noise._FEW + 1), (5, 1001), (9, 4096)])
def test_the_cpu_arrays_are_the_device_tensors_bit_for_bit(rows, num):
    """On the CPU `uniform_rows` computes in numpy's uint32; every other device, in int64 tensors, here run on the CPU."""
    keys = [noise.counter_key(2**64 - 1, 40 + r, 5) for r in range(rows)]
    array = torch.from_numpy(noise._uniform_array(keys, num))
    assert torch.equal(array, noise._uniform_tensor(keys, num, "cpu"))
    assert torch.equal(noise.uniform_rows(2**64 - 1, 40, rows, num, 5), array)


def test_mix32_is_lowbias32():
    words = random_words(2000, seed=1)
    assert [noise.mix32(x) for x in words] == [lowbias32_reference(x) for x in words]


def test_uniform_is_deterministic_and_in_open_interval():
    a = noise.uniform(seed=3, position=17, num=1000)
    b = noise.uniform(seed=3, position=17, num=1000)
    assert a.dtype == torch.float64 and a.shape == (1000,)
    assert torch.equal(a, b)
    assert bool((a > 0).all()) and bool((a < 1).all())


def test_uniform_prefix_does_not_depend_on_num():
    assert torch.equal(noise.uniform(5, 9, 10), noise.uniform(5, 9, 1000)[:10])


@pytest.mark.parametrize("seed, position, stream", [(0, 0, 0), (3, 17, 1), (2**64 - 1, 2**31, 5)])
def test_a_few_uniforms_in_python_are_the_array_path_bit_for_bit(seed, position, stream):
    """Up to `_FEW` elements `uniform` computes in Python: every count on either side of it equals the
    array path's prefix exactly (the CPU's; the tensor path is held to it below), and `scalar_uniform` is its
    first element."""
    array_path = noise.uniform(seed, position, 4 * noise._FEW, stream)  # past `_FEW`: the array path
    for num in range(1, 2 * noise._FEW + 2):
        assert torch.equal(noise.uniform(seed, position, num, stream), array_path[:num]), num
    assert noise.scalar_uniform(seed, position, stream) == float(array_path[0])


@pytest.mark.parametrize("num", [4, 7, 33, 1001])
def test_gumbel_rows_are_gumbel_per_position_bit_for_bit(num):
    """A verifier's block draws its positions' noise at once (`gumbel_rows`): each row must be what a
    one-token step at that position draws, or coupled stages part at a near-tie."""
    for rows in (1, 2, 5, 9):
        block = noise.gumbel_rows(11, 40, rows, num, 2)
        assert block.shape == (rows, num) and block.dtype == torch.float64
        for r in range(rows):
            assert torch.equal(block[r], noise.gumbel(11, 40 + r, num, 2)), (rows, r)


@pytest.mark.parametrize(
    "other",
    [
        dict(seed=4, position=17, stream=0),
        dict(seed=3, position=18, stream=0),
        dict(seed=3, position=17, stream=1),
        dict(seed=3 + (1 << 32), position=17, stream=0),  # the high half of a 64-bit seed counts too
    ],
)
def test_uniform_changes_with_seed_position_and_stream(other):
    base = noise.uniform(3, 17, 256, 0)
    changed = noise.uniform(other["seed"], other["position"], 256, other["stream"])
    assert not torch.equal(base, changed)
    assert float((base == changed).double().mean()) < 0.01  # not merely shifted or partly equal


@pytest.mark.parametrize("seed, position, stream", [(0, 0, 0), (1, 2, 3), (123456789, 40000, 7), (2**63 + 5, 1, 2)])
def test_scalar_uniform_equals_first_tensor_uniform(seed, position, stream):
    assert noise.scalar_uniform(seed, position, stream) == float(noise.uniform(seed, position, 1, stream)[0])


def max_cdf_deviation(samples):
    """Kolmogorov-Smirnov statistic of samples in (0, 1) against the uniform distribution."""
    x, _ = torch.sort(samples.to(torch.float64))
    n = len(x)
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - x
    below = x - torch.arange(0, n, dtype=torch.float64) / n
    return float(torch.maximum(above, below).max())


def test_uniform_is_uniform_along_the_vocabulary():
    # KS critical value at alpha = 0.001 for n = 100k is about 1.95 / sqrt(n) = 0.0062.
    assert max_cdf_deviation(noise.uniform(seed=11, position=5, num=100_000)) < 0.01


def test_scalar_uniform_is_uniform_across_positions():
    # The accept-test uniforms vary by position, not index; 20k samples: KS critical ~0.014 at 0.001.
    samples = torch.tensor([noise.scalar_uniform(7, pos, 2) for pos in range(20_000)])
    assert max_cdf_deviation(samples) < 0.02


def test_gumbel_mean_is_euler_gamma():
    g = noise.gumbel(seed=2, position=0, num=100_000)
    assert torch.isfinite(g).all()
    # Gumbel std is pi / sqrt(6) ~ 1.28: the standard error of the mean is ~0.004.
    assert abs(float(g.mean()) - EULER_GAMMA) < 0.02
    assert torch.equal(g, -torch.log(-torch.log(noise.uniform(2, 0, 100_000))))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_uniform_on_cuda_equals_cpu_bit_for_bit():
    for seed, position, stream in [(0, 0, 0), (3, 17, 1), (2**40 + 1, 999, 5)]:
        cpu = noise.uniform(seed, position, 50_000, stream, device="cpu")
        cuda = noise.uniform(seed, position, 50_000, stream, device="cuda")
        assert torch.equal(cpu, cuda.cpu())
        assert torch.equal(noise.mix32(torch.arange(50_000, device="cuda")).cpu(), noise.mix32(torch.arange(50_000)))
