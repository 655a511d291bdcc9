"""A worker's whole state (module, optimizer, step) as one contiguous byte tensor.

What the peer tier keeps and sends: `pack_state` copies every tensor of the module's and
the optimizer's state dicts into one 64-byte-aligned uint8 buffer (a single send/recv, a
single allocation that can be reused), `unpack_state` restores it bit for bit. The copy is
taken before returning, so the optimizer update that follows cannot leak into it (see
[Note: snapshot consistency] in ``recovery/snapshots/__init__.py``). With ``digests`` (or
`PackedState.digested` later, off the caller's thread) it also records the fingerprint it
was taken with -- an XXH3 digest of each slot's bytes
(`recovery.integrity.fingerprint.digest`) -- which travels in the header, so that a copy
flipped in a holder's memory or on the way is found (`PackedState.corrupted`) before it
is restored. Every peer snapshot records them, fingerprints on or off
(`recovery.worker.keeper.SnapshotKeeper.take`): hashing costs little next to copying.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from parallelism.comm import GarbledMessage
from recovery.integrity.fingerprint import digest
from recovery.state import Progress, WorkerState
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


@dataclass(frozen=True, eq=False)
class PackedState:
    """A worker's whole state (see [Note: one worker state] in recovery/state.py) as one
    contiguous byte tensor and the description a live transfer sends.

    ``data`` is what travels (a single send/recv); `header` is the small rest, in the
    JSON wire format of `recovery.wire` (a received header is never unpickled).
    """

    meta: dict[str, Any]
    """`WorkerState.describe`'s description: the model's tensors, the optimizer's
    structure and the progress."""
    data: torch.Tensor
    """uint8, 1-D, contiguous: every tensor's bytes, each at a 64-byte-aligned offset."""
    layout: tuple[TensorSlot, ...]
    """Where each tensor the description lists lives in ``data``, in its order."""
    digests: tuple[str, ...] | None = None
    """The digest of each slot's bytes when it was packed (None: not recorded)."""
    ready: Any = field(default=None, compare=False, repr=False)
    """A CUDA event recorded after the copies from the GPU into ``data`` were queued (None:
    ``data`` is complete already); see `wait`."""

    @property
    def progress(self) -> Progress:
        progress = self.meta["progress"]
        assert isinstance(progress, Progress)
        return progress

    @property
    def step(self) -> int:
        return self.progress.step

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
        return encode((self.meta, self.layout, self.digests))

    def digested(self) -> PackedState:
        """This state with the digest of each slot's bytes recorded (`corrupted` checks
        them); ``self`` if they are recorded already. Waits for the packed bytes first."""
        if self.digests is not None:
            return self
        self.wait()
        data = self.data
        recorded = tuple(digest(data[s.offset : s.offset + s.nbytes]) for s in self.layout)
        return PackedState(self.meta, data, self.layout, recorded)

    def corrupted(self) -> tuple[str, ...]:
        """The slots whose bytes are not shown intact: those that no longer match the
        digests recorded when this state was packed -- or every slot if none were recorded
        (a copy that cannot be checked is not trusted). Empty: intact."""
        if self.digests is None:
            return tuple(slot.name for slot in self.layout) or ("<no digests recorded>",)
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
                their shapes and dtypes, and the description's tensors the slots).
            ValueError: if ``data`` is not a 1-D uint8 tensor of the size the header needs.
        """
        parts = decode(header)
        if not (isinstance(parts, tuple) and len(parts) == 3):
            raise GarbledMessage("a packed-state header that is not (description, layout, digests)")
        meta, layout, digests = parts
        _check_layout(meta, layout)
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
        return cls(meta, data, layout, digests)


def _described(meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors a description lists, in order: ``(shape, dtype)`` as the slots hold them
    (names aside: a slot is named as the description's tensors are)."""
    shapes = [(str(name), tuple(shape), str(dtype)) for name, shape, dtype in meta["model"]]
    for index, entry in meta["optimizer"]["state"].items():
        for key, (kind, *rest) in entry.items():
            if kind == "tensor":
                shape, dtype = rest
                shapes.append((f"optim.{index}.{key}", tuple(shape), str(dtype)))
    return shapes


def _check_layout(meta: object, layout: object) -> None:
    """A received layout describes tensors this runtime could have packed, the ones its
    description lists."""
    if not (isinstance(layout, tuple) and all(isinstance(s, TensorSlot) for s in layout)):
        raise GarbledMessage("a packed-state header whose layout is not a tuple of slots")
    try:
        if not (isinstance(meta, dict) and isinstance(meta["progress"], Progress)):
            raise TypeError("no progress")
        described = _described(meta)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise GarbledMessage(
            f"a packed-state header whose description does not fit: {err!r}"
        ) from None
    if [(s.shape, s.dtype) for s in layout] != [(shape, dtype) for _, shape, dtype in described]:
        raise GarbledMessage("a packed-state header whose slots are not the tensors it describes")
    for slot in layout:
        shape, dtype = tensor_spec(list(slot.shape), slot.dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not (isinstance(slot.offset, int) and slot.offset >= 0 and slot.nbytes == nbytes):
            raise GarbledMessage(f"a packed-state slot {slot} that does not fit its shape")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _view(data: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    raw = data[slot.offset : slot.offset + slot.nbytes]
    return raw.view(getattr(torch, slot.dtype)).view(slot.shape)


def pack_state(
    state: WorkerState,
    *,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
    digests: bool = False,
) -> PackedState:
    """Copy a worker's whole state into one contiguous byte tensor on ``device`` (host
    memory by default: that is where a buddy keeps it). The copy is taken now; later
    updates to the module or optimizer do not change it.

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
            checks them), at the cost of hashing the state once, on this thread (after
            waiting for a copy from a GPU); `PackedState.digested` does it later.
    """
    meta, found, names = state.describe()
    tensors = list(zip(names, found, strict=True))
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
    packed = PackedState(meta, data, tuple(layout), None, ready)
    return packed.digested() if digests else packed


def _gpu_to_host(
    tensors: list[tuple[str, torch.Tensor]], device: torch.device
) -> torch.device | None:
    """The GPU a state is copied from when it is packed into host memory (None: no copy
    from a GPU, the plain synchronous path)."""
    if device.type != "cpu":
        return None
    return next((t.device for _, t in tensors if t.is_cuda), None)


def unpack_state(packed: PackedState, state: WorkerState) -> Progress:
    """Replace ``state``'s module and optimizer state with ``packed``'s, bit for bit, and
    return its progress (for the caller to adopt). The result shares no memory with
    ``packed``.

    Raises:
        ValueError: if ``packed`` is another stage's or model's state (different names,
            shapes, dtypes or parameter groups), before anything is changed.
    """
    packed.wait()
    meta = packed.meta
    targets = state.model_targets(meta)
    state.check_groups(meta)
    slots = iter(packed.layout)
    with torch.no_grad():
        for target, slot in zip(targets, slots, strict=False):
            target.copy_(_view(packed.data, slot))
    # Optimizer.load_state_dict keeps tensors that already have the right dtype and
    # device, so each one is cloned: the snapshot must stay unchanged by later steps.
    opt_state = state.optimizer_state(
        meta, lambda shape, dtype: _view(packed.data, next(slots)).clone()
    )
    return state.load(meta, opt_state)
