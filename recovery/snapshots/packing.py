"""A worker's whole state (module, optimizer, step) as one contiguous byte tensor.

What the peer tier keeps and sends: `pack_state` copies every tensor of the module's and
the optimizer's state dicts into one 64-byte-aligned uint8 buffer (a single send/recv, a
single allocation that can be reused), `unpack_state` restores it bit for bit. The copy is
taken before returning, so the optimizer update that follows cannot leak into it (see
[Note: snapshot consistency] in ``recovery/snapshots/__init__.py``). With ``digests`` it
also records the fingerprint it was taken with -- a digest of each slot's bytes
(`recovery.fingerprint.digest`) -- which travels in the header, so that a copy flipped in a
holder's memory or on the way is found (`PackedState.corrupted`) before it is restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from parallelism.checks import check_index
from parallelism.comm import GarbledMessage
from recovery.fingerprint import digest
from recovery.wire import decode, encode, record, tensor_spec

__all__ = ["PackedState", "TensorSlot", "pack_state", "unpack_state"]

_ALIGN = 64  # every tensor starts at a multiple of this, so any dtype can view its bytes


@record
@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives inside a `PackedState`'s bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@record
@dataclass(frozen=True)
class _Ref:
    """Stands for tensor ``index`` of the layout inside the optimizer's description."""

    index: int


@dataclass(frozen=True, eq=False)
class PackedState:
    """A worker's state (module, optimizer, step) as one contiguous byte tensor.

    ``data`` is what travels (a single send/recv); `header` is the small rest, in the
    JSON wire format of `recovery.wire` (a received header is never unpickled).
    """

    step: int
    data: torch.Tensor
    """uint8, 1-D, contiguous: every tensor's bytes, each at a 64-byte-aligned offset."""
    layout: tuple[TensorSlot, ...]
    """The model's state_dict tensors (in order), then the optimizer's."""
    model_tensors: int
    """How many leading entries of ``layout`` belong to the module."""
    optimizer: dict[str, Any]
    """``optimizer.state_dict()`` with every tensor replaced by a reference into ``layout``."""
    digests: tuple[str, ...] | None = None
    """The digest of each slot's bytes when it was packed (None: not recorded)."""
    ready: Any = field(default=None, compare=False, repr=False)
    """A CUDA event recorded after the copies from the GPU into ``data`` were queued (None:
    ``data`` is complete already); see `wait`."""

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def wait(self) -> PackedState:
        """Block until ``data`` holds the packed bytes: the copies from a GPU are queued
        asynchronously into pinned host memory (`pack_state`), and must be finished before
        ``data`` is read, sent or restored from. Returns ``self``."""
        if self.ready is not None:
            self.ready.synchronize()
        return self

    def header(self) -> bytes:
        """Everything but ``data``, encoded for the wire: send it first, then ``data``."""
        return encode((self.step, self.layout, self.model_tensors, self.optimizer, self.digests))

    def corrupted(self) -> tuple[str, ...]:
        """The slots whose bytes no longer match the digests recorded when this state was
        packed (empty: intact, or no digests recorded)."""
        if self.digests is None:
            return ()
        self.wait()
        return tuple(
            slot.name
            for slot, recorded in zip(self.layout, self.digests, strict=True)
            if digest(self.data[slot.offset : slot.offset + slot.nbytes]) != recorded
        )

    @classmethod
    def from_parts(cls, header: bytes, data: torch.Tensor) -> PackedState:
        """Rebuild a packed state from a received `header` and ``data``.

        Raises:
            GarbledMessage: if the header is not one `header` makes (its slots must fit
                their shapes and dtypes, and its references the layout).
            ValueError: if ``data`` is not a 1-D uint8 tensor of the size the header needs.
        """
        parts = decode(header)
        if not (isinstance(parts, tuple) and len(parts) == 5):
            raise GarbledMessage(
                "a packed-state header that is not (step, layout, count, optimizer, digests)"
            )
        step, layout, model_tensors, optimizer, digests = parts
        _check_layout(step, layout, model_tensors)
        if digests is not None and not (
            isinstance(digests, tuple)
            and len(digests) == len(layout)
            and all(isinstance(d, str) for d in digests)
        ):
            raise GarbledMessage("a packed-state header whose digests do not fit its layout")
        need = max((s.offset + s.nbytes for s in layout), default=0)
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < need:
            raise ValueError(
                f"packed state data must be 1-D uint8 of at least {need} bytes, got "
                f"{data.dtype} {tuple(data.shape)}"
            )
        return cls(step, data, layout, model_tensors, optimizer, digests)


def _check_layout(step: object, layout: object, model_tensors: object) -> None:
    """A received layout describes tensors this runtime could have packed."""
    ints = (step, model_tensors)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise GarbledMessage(f"a packed-state header with step {step!r}, count {model_tensors!r}")
    if not (isinstance(layout, tuple) and all(isinstance(s, TensorSlot) for s in layout)):
        raise GarbledMessage("a packed-state header whose layout is not a tuple of slots")
    if model_tensors > len(layout):  # type: ignore[operator]
        raise GarbledMessage(f"a packed-state header of {len(layout)} slots, {model_tensors} model")
    for slot in layout:
        shape, dtype = tensor_spec(list(slot.shape), slot.dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not (isinstance(slot.offset, int) and slot.offset >= 0 and slot.nbytes == nbytes):
            raise GarbledMessage(f"a packed-state slot {slot} that does not fit its shape")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flatten(obj: Any, found: list[tuple[str, torch.Tensor]], where: str) -> Any:
    """``obj`` with every tensor replaced by a `_Ref`; the tensors appended to ``found``."""
    if isinstance(obj, torch.Tensor):
        found.append((where, obj))
        return _Ref(len(found) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, found, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_flatten(v, found, f"{where}.{i}") for i, v in enumerate(obj))
    return obj


def _unflatten(obj: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensor(obj.index)
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensor) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_unflatten(v, tensor) for v in obj)
    return obj


def _view(data: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    raw = data[slot.offset : slot.offset + slot.nbytes]
    return raw.view(getattr(torch, slot.dtype)).view(slot.shape)


def pack_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    *,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
    digests: bool = False,
) -> PackedState:
    """Copy a worker's state into one contiguous byte tensor on ``device`` (host memory by
    default: that is where a buddy keeps it). The copy is taken now; later updates to
    the module or optimizer do not change it.

    A state on a GPU is copied into *pinned* host memory asynchronously (``non_blocking``:
    DMAs queued on the GPU's current stream, so the optimizer step queued after them cannot
    leak in) and the result records a CUDA event: `PackedState.wait` blocks until the bytes
    are there, and every reader calls it (`PackedState.corrupted`, `unpack_state`, the
    keeper before it serves a copy). The training thread therefore does not wait for the
    copy; the peer exchange thread does. A state on the CPU is copied as before.

    Args:
        out: a byte tensor to pack into (the data of a snapshot no longer needed) instead
            of allocating: copying into memory already touched is ~3x faster on CPU than
            into fresh pages. Used when it is a 1-D uint8 tensor on ``device`` that is
            large enough, ignored otherwise. Nothing else may still read it.
        digests: record the digest of each tensor's packed bytes (`PackedState.corrupted`
            checks them), at the cost of hashing the state once.

    Raises:
        ValueError: for a negative step.
    """
    check_index("step", step)
    tensors: list[tuple[str, torch.Tensor]] = list(module.state_dict().items())
    model_tensors = len(tensors)
    optimizer_desc = _flatten(optimizer.state_dict(), tensors, "optimizer")
    layout = []
    offset = 0
    for name, t in tensors:
        offset = -(-offset // _ALIGN) * _ALIGN
        nbytes = t.numel() * t.element_size()
        layout.append(TensorSlot(name, tuple(t.shape), _dtype_name(t.dtype), offset, nbytes))
        offset += nbytes
    gpu = _gpu_to_host(tensors, torch.device(device))
    usable = (
        out is not None
        and out.dtype == torch.uint8
        and out.dim() == 1
        and out.device == torch.device(device)
        and out.numel() >= offset
        and (gpu is None or out.is_pinned())
    )
    data = (
        out[:offset]
        if out is not None and usable
        else torch.empty(offset, dtype=torch.uint8, device=device, pin_memory=gpu is not None)
    )
    with torch.no_grad():
        for slot, (_, t) in zip(layout, tensors, strict=True):
            if slot.nbytes:
                flat = t.detach().reshape(-1).view(torch.uint8)
                target = data[slot.offset : slot.offset + slot.nbytes]
                target.copy_(flat, non_blocking=gpu is not None and flat.is_cuda)
    ready = None
    if gpu is not None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(gpu))
    packed = PackedState(step, data, tuple(layout), model_tensors, optimizer_desc, None, ready)
    if not digests:
        return packed
    packed.wait()  # the digests read the bytes
    recorded = tuple(digest(data[slot.offset : slot.offset + slot.nbytes]) for slot in layout)
    return PackedState(step, data, tuple(layout), model_tensors, optimizer_desc, recorded)


def _gpu_to_host(
    tensors: list[tuple[str, torch.Tensor]], device: torch.device
) -> torch.device | None:
    """The GPU a state is copied from when it is packed into host memory (None: no copy
    from a GPU, the plain synchronous path)."""
    if device.type != "cpu":
        return None
    return next((t.device for _, t in tensors if t.is_cuda), None)


def unpack_state(packed: PackedState, module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Replace ``module``'s and ``optimizer``'s state with ``packed``'s, bit for bit.
    Returns its step. The result shares no memory with ``packed``.

    Raises:
        ValueError: if ``packed`` is another stage's or model's state (different names,
            shapes, dtypes or parameter groups), before anything is changed.
    """
    packed.wait()
    model = module.state_dict()
    expected = [(k, tuple(v.shape), _dtype_name(v.dtype)) for k, v in model.items()]
    got = [(s.name, s.shape, s.dtype) for s in packed.layout[: packed.model_tensors]]
    if expected != got:
        diff = next(
            (f"{e} vs {g}" for e, g in zip(expected, got, strict=False) if e != g),
            f"{len(expected)} tensors vs {len(got)}",
        )
        raise ValueError(f"packed state does not match this module: first difference {diff}")
    groups = [len(g["params"]) for g in optimizer.param_groups]
    packed_groups = [len(g["params"]) for g in packed.optimizer["param_groups"]]
    if groups != packed_groups:
        raise ValueError(
            f"packed optimizer state has parameter groups of sizes {packed_groups}, this "
            f"optimizer {groups}"
        )
    with torch.no_grad():
        for slot, key in zip(packed.layout, model, strict=False):
            model[key].copy_(_view(packed.data, slot))
    # Optimizer.load_state_dict keeps tensors that already have the right dtype and
    # device, so each one is cloned: the snapshot must stay unchanged by later steps.
    state = _unflatten(packed.optimizer, lambda i: _view(packed.data, packed.layout[i]).clone())
    optimizer.load_state_dict(state)
    return packed.step
