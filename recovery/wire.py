"""What workers send each other besides raw tensor bytes: a JSON header, never a pickle.

A state transfer or a peer snapshot travels as a small description (names, shapes,
dtypes, optimizer hyper-parameters, the step) followed by the tensors themselves. The
description used to be pickled, so any process that could reach a worker's ports could
make it run code. It is JSON now, with a few tagged forms for what JSON lacks (tuples,
dicts with non-string keys, small scalar tensors, the two record types below), decoded
by a closed list of constructors, and everything it implies is checked before any
memory is allocated:

- a header's length is read first and must be in ``(0, MAX_HEADER_BYTES]``;
- it is parsed once, bounded: JSON nested at most ``MAX_DEPTH`` levels deep, at most
  ``MAX_ITEMS`` values in all (a dict's keys included), counted as the values are read;
- every shape is a list of non-negative integers, every dtype one of `DTYPES`, and one
  tensor's bytes at most ``MAX_TENSOR_BYTES``; all the tensors of one message draw on one
  budget, the memory of the device they land on, through the one allocation helper every
  receive uses ([Note: what a received message may allocate] in parallelism/comm/wire.py).

Anything else -- the garbage a receive buffer holds after a peer aborted mid-message, or
bytes from a stranger -- raises `parallelism.comm.GarbledMessage`, a communication error
(``ConnectionError``) that the runtime handles like a lost peer, never an ``IndexError``,
a ``MemoryError``, a ``RecursionError`` or a ``UnicodeDecodeError``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import torch

from parallelism.comm import GarbledMessage, ReceiveBudget, StageComm, empty_received

__all__ = [
    "DTYPES",
    "MAX_DEPTH",
    "MAX_HEADER_BYTES",
    "MAX_ITEMS",
    "MAX_TENSOR_BYTES",
    "decode",
    "encode",
    "recv_header",
    "send_header",
    "tensor_spec",
]

MAX_HEADER_BYTES = 64 << 20
"""The largest description accepted (a 64 MiB JSON header is millions of tensors)."""
MAX_DEPTH = 64
"""The deepest nesting of lists and dicts accepted (a state description nests about 12)."""
MAX_ITEMS = 1 << 22
"""The most values accepted in one header, containers and a dict's keys included (a state
description holds about 30 per parameter tensor)."""
MAX_TENSOR_BYTES = 1 << 40
"""The largest single tensor accepted (1 TiB)."""
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_SMALL_TENSOR = 64
"""Tensors up to this many elements (Adam's step count) travel inside the header."""
_TAG = "__wire__"

_RECORDS: dict[str, type] = {}


def record(cls: type) -> type:
    """Register a frozen dataclass whose fields are wire values, so it can travel in a header."""
    assert dataclasses.is_dataclass(cls)
    _RECORDS[cls.__name__] = cls
    return cls


def _tag(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_TAG: "float", "v": repr(obj)}
    if isinstance(obj, list):
        return [_tag(v) for v in obj]
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "v": [_tag(v) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k != _TAG for k in obj):
            return {k: _tag(v) for k, v in obj.items()}
        return {_TAG: "dict", "v": [[_tag(k), _tag(v)] for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor) and obj.numel() <= _SMALL_TENSOR:
        name = str(obj.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {obj.dtype} in a header")
        values = obj.detach().cpu()
        data = values.float().tolist() if obj.dtype == torch.bfloat16 else values.tolist()
        return {_TAG: "tensor", "dtype": name, "shape": list(obj.shape), "v": _tag(data)}
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _RECORDS:
        fields = {f.name: _tag(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {_TAG: "record", "type": type(obj).__name__, "v": fields}
    raise TypeError(f"{type(obj).__name__} cannot travel in a wire header")


class _Reader:
    """One header's parsed JSON turned into values, bounded as it goes: ``MAX_DEPTH``
    levels of nesting, ``MAX_ITEMS`` values (the recursion is bounded by the first)."""

    def __init__(self) -> None:
        self.values = 0

    def read(self, obj: Any, depth: int = 1) -> Any:
        self.values += 1 + (len(obj) if isinstance(obj, dict) else 0)
        if self.values > MAX_ITEMS:
            raise GarbledMessage(f"a wire header of more than {MAX_ITEMS} values")
        if not isinstance(obj, list | dict):
            return obj
        if depth > MAX_DEPTH:
            raise GarbledMessage(f"a wire header nested deeper than {MAX_DEPTH} levels")
        inner = depth + 1
        if isinstance(obj, list):
            return [self.read(v, inner) for v in obj]
        kind = obj.get(_TAG)
        if kind is None:
            return {k: self.read(v, inner) for k, v in obj.items()}
        if kind == "float" and obj.get("v") in ("inf", "-inf", "nan"):
            return float(obj["v"])
        if kind == "tuple" and isinstance(obj.get("v"), list):
            return tuple(self.read(v, inner) for v in obj["v"])
        if kind == "dict" and isinstance(obj.get("v"), list):
            pairs = obj["v"]
            if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                raise GarbledMessage("a wire header's dict is not a list of pairs")
            return {_hashable(self.read(k, inner)): self.read(v, inner) for k, v in pairs}
        if kind == "tensor":
            shape, dtype = tensor_spec(obj.get("shape"), obj.get("dtype"))
            if math.prod(shape) > _SMALL_TENSOR:
                raise GarbledMessage(f"an inline tensor of shape {list(shape)} in a wire header")
            try:
                return torch.tensor(self.read(obj.get("v"), inner), dtype=dtype).reshape(shape)
            except (TypeError, ValueError, RuntimeError) as err:
                raise GarbledMessage(
                    f"a wire header's inline tensor does not decode: {err}"
                ) from None
        if kind == "record" and obj.get("type") in _RECORDS and isinstance(obj.get("v"), dict):
            cls = _RECORDS[obj["type"]]
            names = {f.name for f in dataclasses.fields(cls)}
            if set(obj["v"]) != names:
                raise GarbledMessage(f"a wire header's {obj['type']} has fields {sorted(obj['v'])}")
            try:  # a record checks its fields (`__post_init__`): what it refuses is garbled
                return cls(**{k: self.read(v, inner) for k, v in obj["v"].items()})
            except (TypeError, ValueError) as err:
                raise GarbledMessage(
                    f"a wire header's {obj['type']} does not decode: {err}"
                ) from None
        raise GarbledMessage(f"unknown or malformed tag {kind!r} in a wire header")


def _hashable(key: Any) -> Any:
    if isinstance(key, list | dict):
        raise GarbledMessage("a wire header's dict key is not a number or a string")
    return key


def encode(obj: Any) -> bytes:
    """``obj`` (JSON values, tuples, dicts with int keys, small tensors, `record` types) as
    header bytes.

    Raises:
        TypeError: for anything else (a bug of the sender, not a wire error).
    """
    return json.dumps(_tag(obj), separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes) -> Any:
    """The object `encode` made ``data`` from, parsed within the bounds of the module's
    docstring (bytes, nesting, values).

    Raises:
        GarbledMessage: for bytes that are not a header `encode` could have made, or one
            out of bounds.
    """
    if not 0 < len(data) <= MAX_HEADER_BYTES:
        raise GarbledMessage(f"a wire header of {len(data)} bytes")
    try:
        parsed = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:  # the C parser's own guard, far past MAX_DEPTH
        raise GarbledMessage(f"a wire header nested deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GarbledMessage(f"a wire header that is not JSON: {err}") from None
    return _Reader().read(parsed)


def _refuse_constant(name: str) -> Any:
    raise GarbledMessage(f"a bare {name} in a wire header")


def tensor_spec(shape: object, dtype: object) -> tuple[tuple[int, ...], torch.dtype]:
    """Validate a received shape and dtype name before anything is allocated for them.

    Raises:
        GarbledMessage: for a shape that is not a list of non-negative integers, an unknown
            dtype, or more than ``MAX_TENSOR_BYTES``.
    """
    if not isinstance(shape, Sequence) or isinstance(shape, str) or len(shape) > 32:
        raise GarbledMessage(f"a tensor shape {shape!r} in a wire header")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise GarbledMessage(f"a tensor shape {list(shape)} in a wire header")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise GarbledMessage(f"a tensor dtype {dtype!r} in a wire header")
    torch_dtype = DTYPES[dtype]
    nbytes = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
    if nbytes > MAX_TENSOR_BYTES:
        raise GarbledMessage(f"a tensor of {nbytes} bytes (shape {list(shape)}) in a wire header")
    return tuple(shape), torch_dtype


def send_header(comm: StageComm, dst: int, obj: Any) -> int:
    """Post ``obj``'s header (its length, then its bytes) to ``dst``; returns the bytes."""
    blob = torch.frombuffer(bytearray(encode(obj)), dtype=torch.uint8)
    comm.isend(torch.tensor([blob.numel()], dtype=torch.int64, device=comm.wire), dst)
    comm.isend(blob.to(comm.wire), dst)
    return int(blob.numel())


def recv_header(comm: StageComm, src: int) -> tuple[Any, int]:
    """Receive what `send_header` sent: ``(obj, bytes)``.

    Raises:
        GarbledMessage: for a length out of bounds or bytes that do not decode.
    """
    size = int(comm.recv(torch.empty(1, dtype=torch.int64, device=comm.wire), src).item())
    if not 0 < size <= MAX_HEADER_BYTES:
        raise GarbledMessage(f"a wire header length of {size} bytes from rank {src}")
    what = f"a wire header from rank {src}"
    blob = comm.recv(
        empty_received((size,), torch.uint8, comm.wire, what, ReceiveBudget(comm.wire)), src
    )
    return decode(blob.cpu().numpy().tobytes()), size
