"""Pipeline messages <-> msgpack bytes, exactly: the payload of every gRPC frame.

Messages are frozen dataclasses (pipespec.messages, pipespec.stats, pipespec.params); each becomes a
msgpack map tagged with its class name. Tuples, frozensets and enums keep their types. Tensors (q
rows, hidden states) and numpy arrays (image pixels) travel as raw bytes with dtype and shape and
come back bit for bit, bf16 included; torch is imported only when a tensor is met, so the
coordinator stays torch-free. A tensor on a GPU is copied to the CPU to be framed; every tensor
comes back on the CPU, and the stage receiving it moves it to its own device (pipespec.stages.device).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from pipespec import messages, params, stats

if TYPE_CHECKING:
    from pipespec.config import LimitsSpec

_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for module in (messages, stats, params)
    for cls in vars(module).values()
    if isinstance(cls, type)
    and (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum))
    and cls.__module__ == module.__name__
}


def _pack(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {"__t": type(obj).__name__}
        for f in dataclasses.fields(obj):
            out[f.name] = _pack(getattr(obj, f.name))
        return out
    if isinstance(obj, enum.Enum):
        return {"__e": type(obj).__name__, "v": obj.value}
    if isinstance(obj, tuple):
        return {"__tuple": [_pack(x) for x in obj]}
    if isinstance(obj, frozenset):
        return {"__fset": sorted(_pack(x) for x in obj)}
    if isinstance(obj, list):
        return [_pack(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if type(obj).__module__ == "torch" and type(obj).__name__ == "Tensor":
        return _pack_tensor(obj)
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return {"__ndarray": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}
    return obj


def _pack_tensor(t: Any) -> dict:
    import torch

    t = t.detach().cpu().contiguous()  # a CUDA tensor: copied to the host (what leaves a process is on the CPU)
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bf16
    return {"__tensor": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": raw.numpy().tobytes()}


def _unpack(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_unpack(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__t" in obj:
        cls = _CLASSES[obj["__t"]]
        return cls(**{k: _unpack(v) for k, v in obj.items() if k != "__t"})
    if "__e" in obj:
        return _CLASSES[obj["__e"]](obj["v"])
    if "__tuple" in obj:
        return tuple(_unpack(x) for x in obj["__tuple"])
    if "__fset" in obj:
        return frozenset(_unpack(x) for x in obj["__fset"])
    if "__tensor" in obj:
        return _unpack_tensor(obj)
    if "__ndarray" in obj:
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["__ndarray"])).reshape(obj["shape"]).copy()
    return {k: _unpack(v) for k, v in obj.items()}


def _unpack_tensor(obj: dict) -> Any:
    import torch

    dtype = getattr(torch, obj["__tensor"])
    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(obj["data"]), dtype=carrier) if obj["data"] else torch.empty(0, dtype=carrier)
    return flat.view(dtype).reshape(obj["shape"])


def encode(message: Any) -> bytes:
    return msgpack.packb(_pack(message), use_bin_type=True)


class FrameError(ValueError):
    """A frame that is not a well-formed pipeline message, or is larger than its kind's limit."""


def decode(payload: bytes, limits: LimitsSpec | None = None) -> Any:
    """The message in `payload`; with `limits` (a frame from a peer), a frame that is malformed, mistyped
    or over its kind's size limit raises FrameError."""
    return _unpack(msgpack.unpackb(payload, raw=False, strict_map_key=False))
