"""Pipeline messages <-> msgpack bytes, exactly: the payload of every gRPC frame.

Messages are frozen dataclasses (this room's `messages`, `stats`, `params` and `logprobs`); each
becomes a msgpack map tagged with its class name. Tuples, frozensets and enums keep their types;
floats are float64, infinities included (a logprob of -inf). Tensors (q rows, hidden states) and
numpy arrays (image pixels) travel as raw bytes with dtype and shape and come back bit for bit,
bf16 included; torch is imported only when a tensor is met, so the coordinator stays torch-free. A
tensor on a GPU is copied to the CPU to be framed; every tensor comes back on the CPU, and the stage
receiving it moves it to its own device (pipespec.stages.device).

A frame from a peer is decoded with `limits` and trusted for nothing: its kind (the class tag the
encoder writes first) is read before the body and the frame refused if it is over that kind's size
limit (`frame_limit`); then the body is built only as its dataclasses' annotations allow, each value
checked against its field's type (ints are ints, tuples of ints, tensors where `Tensor` is annotated,
numpy arrays where `Array` is). A frame that is malformed, of an unknown kind, with a missing,
unknown or mistyped field, or too large raises `FrameError`, which names the kind and the field.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, Union, get_args, get_origin, get_type_hints

import msgpack
import numpy as np

from pipespec.protocol import logprobs, messages, params, stats

if TYPE_CHECKING:
    import torch

_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for module in (messages, stats, params, logprobs)
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
        return _unpack_ndarray(obj)
    return {k: _unpack(v) for k, v in obj.items()}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _unpack_tensor(obj: dict) -> Any:
    import torch

    dtype = _torch_dtypes()[obj["__tensor"]]
    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(obj["data"]), dtype=carrier) if obj["data"] else torch.empty(0, dtype=carrier)
    return flat.view(dtype).reshape(obj["shape"])


def _unpack_ndarray(obj: dict) -> np.ndarray:
    return np.frombuffer(obj["data"], dtype=np.dtype(obj["__ndarray"])).reshape(obj["shape"]).copy()


def encode(message: Any) -> bytes:
    return msgpack.packb(_pack(message), use_bin_type=True)


class FrameError(ValueError):
    """A frame that is not a well-formed pipeline message, or is larger than its kind's limit."""


SMALL_FRAME_BYTES = 2**20  # the limit of the kinds that carry no tensor or array (Verdict, Commit, Close, ...)


class FrameLimits(Protocol):
    """What decoding a peer's frame reads of a config's limits (a `pipespec.config.LimitsSpec`)."""

    @property
    def frame_bytes(self) -> int: ...  # the largest frame of a kind that can carry a tensor or an array


def decode(payload: bytes, limits: FrameLimits | None = None) -> Any:
    """The message in `payload`; with `limits` (a frame from a peer), a frame that is malformed, mistyped
    or over its kind's size limit raises FrameError."""
    if limits is None:
        return _unpack(msgpack.unpackb(payload, raw=False, strict_map_key=False))
    kind = _kind(payload)
    limit = frame_limit(kind, limits)
    if len(payload) > limit:
        raise FrameError(f"a {kind} frame of {len(payload)} bytes is over the limit of {limit} bytes for {kind}")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise FrameError(f"a {kind} frame is not valid msgpack: {error}") from error
    return _builder(_MESSAGES[kind])(body, kind)


def frame_limit(kind: str, limits: FrameLimits) -> int:
    """The largest frame of pipeline message `kind`: `limits.frame_bytes` if it can carry a tensor or an
    array (an Open with its image, a Draft with q rows, TargetFeatures), else SMALL_FRAME_BYTES."""
    return limits.frame_bytes if _BULKY[kind] else SMALL_FRAME_BYTES


def _kind(payload: bytes) -> str:
    """The pipeline message kind of `payload`, read from its first bytes (the encoder writes the tag first)."""
    head = msgpack.Unpacker(raw=False, max_buffer_size=_HEAD_BYTES)
    head.feed(memoryview(payload)[:_HEAD_BYTES])
    try:
        head.read_map_header()
        key, kind = head.unpack(), head.unpack()
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise FrameError(f"a frame of {len(payload)} bytes does not start as a pipeline message: {error}") from error
    if key != "__t" or not isinstance(kind, str):
        raise FrameError(f"a frame of {len(payload)} bytes does not start with its message kind (its first key is {key!r})")
    if kind not in _MESSAGES:
        raise FrameError(f"a frame of unknown kind {kind[:64]!r}: the pipeline's are {sorted(_MESSAGES)}")
    return kind


_HEAD_BYTES = 64  # a map header, "__t" and the longest kind name fit
_MESSAGES: dict[str, type] = {cls.__name__: cls for cls in get_args(messages.Message)}


Build = Callable[[Any, str], Any]  # (decoded msgpack, where it is: "Kind.field...") -> the value, or FrameError


@functools.cache
def _builder(hint: Any) -> Build:
    """How to build a value of type `hint` from decoded msgpack, checking it; made once per type."""
    origin, args = get_origin(hint), get_args(hint)
    if hint == messages.Tensor:
        return _build_tensor
    if hint == messages.Array:
        return _build_ndarray
    if (origin is Union or origin is types.UnionType) and len(args) == 2 and type(None) in args:
        return _optional(_builder(next(arm for arm in args if arm is not type(None))))
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, {name: _builder(h) for name, h in _hints(hint).items()})
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint)
    if origin is frozenset or origin is list or (origin is tuple and args[1:] == (Ellipsis,)):
        return _collection(hint, origin, _builder(args[0]), args[0] is int)
    if origin is dict:
        return _dict(hint, _builder(args[0]), _builder(args[1]))
    if hint in (int, float, str, bytes, bool):
        return _scalar(hint)
    raise TypeError(f"pipespec.protocol.codec cannot check a field of type {hint!r}")


def _optional(build: Build) -> Build:
    """X | None: X's own error names the field inside X that is wrong."""
    return lambda raw, where: None if raw is None else build(raw, where)


def _dataclass(cls: type, fields: dict[str, Build]) -> Build:
    def build(raw: Any, where: str) -> Any:
        if not (isinstance(raw, dict) and raw.get("__t") == cls.__name__):
            raise _mistyped(raw, cls, where)
        if len(raw) != len(fields) + 1 or not all(name in raw for name in fields):
            unknown = [k for k in raw if k != "__t" and k not in fields]
            if unknown:
                raise FrameError(f"{where}: unknown field {unknown[0]!r} (a {cls.__name__} has {', '.join(fields)})")
            raise FrameError(f"{where}: missing field {next(name for name in fields if name not in raw)!r}")
        values = {name: build_field(raw[name], f"{where}.{name}") for name, build_field in fields.items()}
        try:
            return cls(**values)
        except (TypeError, ValueError) as error:  # the class's own checks (SamplingParams' ranges)
            raise FrameError(f"{where}: {error}") from error

    return build


def _enum(cls: type[enum.Enum]) -> Build:
    def build(raw: Any, where: str) -> Any:
        if not (isinstance(raw, dict) and raw.keys() == {"__e", "v"} and raw["__e"] == cls.__name__):
            raise _mistyped(raw, cls, where)
        try:
            return cls(raw["v"])
        except ValueError as error:
            raise FrameError(f"{where}: {error}") from error

    return build


def _collection(hint: Any, origin: type, item: Build, of_ints: bool) -> Build:
    """A tuple[X, ...], a frozenset[X] or a list[X]."""
    tag = {tuple: "__tuple", frozenset: "__fset", list: None}[origin]

    def build(raw: Any, where: str) -> Any:
        items = raw[tag] if tag is not None and isinstance(raw, dict) and raw.keys() == {tag} else raw
        if not isinstance(items, list) or (tag is not None and items is raw):
            raise _mistyped(raw, hint, where)
        if not (of_ints and all(type(x) is int for x in items)):  # token ids, fast: a long Commit must not hold up the loop
            items = [item(x, f"{where}[{i}]") for i, x in enumerate(items)]
        return items if origin is list else origin(items)

    return build


def _dict(hint: Any, key: Build, value: Build) -> Build:
    def build(raw: Any, where: str) -> dict:
        if not isinstance(raw, dict):
            raise _mistyped(raw, hint, where)
        return {key(k, f"{where} key"): value(v, f"{where}[{k!r}]") for k, v in raw.items()}

    return build


def _scalar(cls: type) -> Build:
    """Exactly `cls`: a bool is no int; an int is a float, as in Python's typing."""
    accepted = (float, int) if cls is float else (cls,)

    def build(raw: Any, where: str) -> Any:
        if type(raw) not in accepted:
            raise _mistyped(raw, cls, where)
        return raw

    return build


def _build_tensor(raw: Any, where: str) -> Any:
    if not (isinstance(raw, dict) and raw.keys() == {"__tensor", "shape", "data"}):
        raise _mistyped(raw, messages.Tensor, where)
    dtype = _torch_dtypes().get(raw["__tensor"]) if isinstance(raw["__tensor"], str) else None
    if dtype is None:
        raise FrameError(f"{where}: a tensor of unknown dtype {raw['__tensor']!r}")
    _check_shape(raw, dtype.itemsize, where)
    try:
        return _unpack_tensor(raw)
    except (TypeError, ValueError, RuntimeError) as error:
        raise FrameError(f"{where}: {error}") from error


def _build_ndarray(raw: Any, where: str) -> np.ndarray:
    if not (isinstance(raw, dict) and raw.keys() == {"__ndarray", "shape", "data"}):
        raise _mistyped(raw, messages.Array, where)
    try:
        dtype = np.dtype(raw["__ndarray"]) if isinstance(raw["__ndarray"], str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in "biufc":
        raise FrameError(f"{where}: an array of dtype {raw['__ndarray']!r}, not a number or bool")
    _check_shape(raw, dtype.itemsize, where)
    return _unpack_ndarray(raw)


def _check_shape(raw: dict, itemsize: int, where: str) -> None:
    """`raw["data"]` holds exactly the bytes of an array of `raw["shape"]`."""
    shape, data = raw["shape"], raw["data"]
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise FrameError(f"{where}: shape {shape!r:.80} is not a list of sizes")
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * itemsize:
        size = len(data) if isinstance(data, bytes) else type(data).__name__
        raise FrameError(f"{where}: shape {shape} takes {math.prod(shape) * itemsize} bytes, the data is {size}")


def _mistyped(raw: Any, hint: Any, where: str) -> FrameError:
    if isinstance(raw, dict) and isinstance(raw.get("__t"), str):
        got = f"a {raw['__t'][:64]}"
    else:
        got = f"{type(raw).__name__} {raw!r:.60}"
    return FrameError(f"{where}: expected {_type_name(hint)}, got {got}")


def _type_name(hint: Any) -> str:
    if hint == messages.Tensor:
        return "a torch tensor"
    if hint == messages.Array:
        return "a numpy array"
    return hint.__name__ if isinstance(hint, type) else str(hint)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's fields and their types, `Tensor` and `Array` markers kept."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _carries_arrays(hint: Any) -> bool:
    """Whether a value of type `hint` can hold a tensor or an array."""
    if hint == messages.Tensor or hint == messages.Array:
        return True
    if dataclasses.is_dataclass(hint):
        return any(_carries_arrays(h) for h in _hints(hint).values())
    return any(_carries_arrays(a) for a in get_args(hint))


_BULKY: dict[str, bool] = {kind: _carries_arrays(cls) for kind, cls in _MESSAGES.items()}
for _cls in _MESSAGES.values():
    _builder(_cls)  # every field's type can be checked (a TypeError at import if not)
