"""Counter-based noise: the same random numbers on every stage, device and run.

Coupled sampling needs every stage to see *identical* Gumbel noise for a given (seed, position,
token id), whatever device it runs on and whatever else it has drawn before. A device RNG cannot
promise that; a hash of the counter can. The hash is Chris Wellons' `lowbias32`, computed on a
device with integer operations that never overflow int64 (32x16-bit partial products), on the CPU
in numpy's uint32 (products wrap modulo 2**32 by themselves: ten times faster on one thread), so
every device agrees bit for bit on the integers; only the final `log` is floating point.

Streams separate independent uses of the noise at the same position: coupled choices use stream 0
on every stage (that is the coupling); rejection sampling gives each stage its own streams.
"""

from __future__ import annotations

import numpy as np
import torch

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for 0 <= x < 2**32. A tensor never overflows int64 on the way (32x16-bit partial
    products); Python ints are unbounded, and numpy's int64 wraps modulo 2**64 and its uint32 modulo 2**32,
    multiples of 2**32: they take the product as it is, the same bits in a few times fewer operations."""
    if isinstance(x, np.ndarray) and x.dtype == np.uint32:
        return x * np.uint32(c)
    if isinstance(x, (int, np.ndarray)):
        return (x * c) & _M32
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """lowbias32: a 32-bit integer hash with good avalanche. Works on ints, int64 tensors and int64 or uint32 arrays."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_key(seed: int, position: int, stream: int = 0) -> tuple[int, int]:
    """Two 32-bit keys for one (seed, position, stream) counter."""
    seed &= (1 << 64) - 1
    k = mix32(stream * 0x9E3779B9 & _M32)
    k = mix32(k ^ (position & _M32))
    k = mix32(k ^ (seed & _M32))
    k = mix32(k ^ (seed >> 32))
    return k, mix32(k ^ 0x5BD1E995)


def uniform(seed: int, position: int, num: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """[num] float64 uniforms in (0, 1), element i keyed by (seed, position, stream, i)."""
    return uniform_rows(seed, position, 1, num, stream, device)[0]


def uniform_rows(seed: int, start: int, rows: int, num: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, num] float64 uniforms: row r is `uniform(seed, start + r, num, stream)`, all rows in one pass."""
    if rows * num <= _FEW:  # a dozen small array operations cost more than the same integers in Python
        values = [_uniforms(seed, start + r, num, stream) for r in range(rows)]
        return torch.tensor(values, dtype=torch.float64, device=device).reshape(rows, num)
    keys = [counter_key(seed, start + r, stream) for r in range(rows)]
    if torch.device(device).type == "cpu":
        return torch.from_numpy(_uniform_array(keys, num))
    return _uniform_tensor(keys, num, device)


def _uniform_tensor(keys: list[tuple[int, int]], num: int, device: torch.device | str) -> torch.Tensor:
    """`uniform_rows` on `device`, row r keyed by keys[r], in int64 tensors: [rows, num] float64."""
    k = torch.tensor(keys, dtype=torch.int64, device=device)  # [rows, 2]
    high, low = _halves(torch.arange(num, dtype=torch.int64, device=device), k[:, :1], k[:, 1:])  # [rows, num] each
    bits = high * (1 << 26) + low  # 52 random bits: bits + 0.5 is exact in float64
    return (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 52))


def _halves(idx: torch.Tensor | np.ndarray, k1: torch.Tensor | np.ndarray, k2: torch.Tensor | np.ndarray):
    """idx [num], keys k1 and k2 [rows, 1] -> the two 26-bit halves of each element's random bits, [rows, num] each
    (int64 tensors, or uint32 arrays)."""
    return mix32(mix32(idx ^ k1) ^ k2) >> 6, mix32(mix32(idx ^ k2) ^ k1) >> 6


def _uniform_array(keys: list[tuple[int, int]], num: int) -> np.ndarray:
    """`uniform_rows` on the CPU, row r keyed by keys[r]: `_uniform_tensor`'s integers in numpy's uint32, whose
    products wrap by themselves (torch has no uint32 arithmetic), then its exact float64 steps. [rows, num]
    float64; a tenth of the int64 tensors' time on a CPU (experiments/results/noise/README.md)."""
    k = np.array(keys, dtype=np.uint32)  # [rows, 2]
    high, low = _halves(np.arange(num, dtype=np.uint32), k[:, :1], k[:, 1:])  # [rows, num] each
    bits = high.astype(np.int64) * (1 << 26) + low
    return (bits + 0.5) * (1.0 / (1 << 52))


def gumbel(seed: int, position: int, num: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """[num] float64 standard Gumbel noise, element i keyed by (seed, position, stream, i)."""
    return gumbel_rows(seed, position, 1, num, stream, device)[0]


def gumbel_rows(seed: int, start: int, rows: int, num: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, num] float64 standard Gumbel noise: row r is `gumbel(seed, start + r, num, stream)`, bit for bit.
    The logs run row by row, as a one-row call runs them: an element's bits cannot depend on how many rows
    were asked for, whatever the log kernel does with a tensor's length."""
    return torch.stack([-torch.log(-torch.log(row)) for row in uniform_rows(seed, start, rows, num, stream, device)])


def scalar_uniform(seed: int, position: int, stream: int) -> float:
    """One uniform in (0, 1) for (seed, position, stream), computed in Python integers: `uniform`'s first element."""
    return _uniforms(seed, position, 1, stream)[0]


# Up to this many elements `uniform_rows` computes in Python integers, where that is faster than array operations
# (mock stages' vocabularies; experiments/results/noise/README.md).
_FEW = 12


def _uniforms(seed: int, position: int, num: int, stream: int) -> list[float]:
    """`uniform`'s elements in Python integers and floats: the same bits, and the same float64 arithmetic
    (each step exact), so the same values."""
    k1, k2 = counter_key(seed, position, stream)
    out = []
    for i in range(num):
        h1, h2 = mix32(mix32(i ^ k1) ^ k2), mix32(mix32(i ^ k2) ^ k1)
        out.append(((h1 >> 6) * (1 << 26) + (h2 >> 6) + 0.5) * (1.0 / (1 << 52)))
    return out
