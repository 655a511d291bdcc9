"""Tensors between the compute device and the wire, and what a message on the wire may be.

The backend moves bytes on the *wire device* (host memory for Gloo, the GPU for NCCL),
which need not be where a worker computes ([Note: compute device and wire device] in
parallelism/devices.py): `to_wire` stages a tensor for sending, `wire_buffer` is a landing
buffer, `land` and `from_wire` bring what arrived back, and `StagedWork` copies a staged
collective's result back when it is waited on. An activation travels as a small header
(`pack_activation_header`) and its tensor; a header that is not one this runtime sends
(`unpack_activation_header`), or a tensor that cannot be allocated (`empty_received`),
is a `GarbledMessage`, a communication error like a lost peer.

[Note: what a received message may allocate]
A receiver allocates what a peer announces before the bytes arrive, so an announcement is
checked twice before memory is taken for it: each tensor against its own bounds (the
header's checks), and every tensor of one message -- a state description, a peer copy,
a mirror update, an activation tuple -- against one `ReceiveBudget`: the whole memory of
the device it lands on (`message_budget`). Each tensor in bounds is not enough: a garbled
or hostile header could announce many, and the allocator's laziness (pages are only
taken when written) would let the receive run until the kernel kills the worker.
`empty_received` is the one way a receive path allocates an announced size.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
from typing import Any

import torch
import torch.distributed as dist

from parallelism.errors import CommError


class GarbledMessage(CommError):
    """Bytes from a peer that are not a message this runtime sends: a header out of bounds
    or that does not decode (what a receive buffer holds after the sender aborted
    mid-message, or what a stranger sends). A communication error, like a lost peer."""


Activation = torch.Tensor | tuple[torch.Tensor, ...]
"""What one stage passes to the next: one tensor, or a tuple of tensors."""

# dtype codes for activation metadata headers (see `pack_activation_header`).
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8
ACTIVATION_HEADER_LEN = 4 + _MAX_DIMS  # ndim, dtype, tuple size, requires grad, shape
"""int64s in one activation header."""
MAX_TUPLE = 64  # tensors in one activation
_MAX_ELEMENTS = 1 << 36  # elements in one activation tensor (256 GiB of float32)


@functools.cache
def _device_memory(kind: str, index: int | None) -> int:
    if kind == "cuda":
        at = torch.cuda.current_device() if index is None else index
        return int(torch.cuda.get_device_properties(at).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def message_budget(device: torch.device) -> int:
    """The most bytes one received message may announce for tensors landing on ``device``:
    its whole memory (host memory for anything but CUDA). See [Note: what a received
    message may allocate]."""
    return _device_memory(device.type, device.index)


class ReceiveBudget:
    """What the tensors of one received message may still take on ``device`` (see [Note:
    what a received message may allocate]); `empty_received` draws on it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.left = message_budget(device)

    def take(self, nbytes: int, what: str) -> None:
        """Take ``nbytes`` for one more tensor of the message.

        Raises:
            GarbledMessage: if the message would then announce more than the budget.
        """
        if nbytes > self.left:
            raise GarbledMessage(
                f"{what} announces {nbytes} more bytes with {self.left} left of this "
                f"message's budget ({message_budget(self.device)} bytes, {self.device}'s "
                "memory): a garbled header"
            )
        self.left -= nbytes


def empty_received(
    shape: list[int] | tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    budget: ReceiveBudget,
) -> torch.Tensor:
    """An uninitialised tensor for what a received header announces (already checked
    against its own bounds), drawn on the message's ``budget`` first: the one way a
    receive allocates an announced size ([Note: what a received message may allocate]).

    Raises:
        GarbledMessage: for a shape that is not a list of non-negative integers, one over
            what is left of ``budget``, or one that cannot be allocated: in bounds is not
            the same as possible, and a failed allocation would otherwise read as a bug in
            user code and end the job.
    """
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise GarbledMessage(f"{what} announces a tensor of shape {list(shape)}")
    budget.take(math.prod(shape) * dtype.itemsize, what)
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as err:
        first = str(err).strip().splitlines()
        raise GarbledMessage(
            f"{what} announces a {dtype} tensor of shape {list(shape)} that cannot be "
            f"allocated on {device} ({first[-1][:200] if first else type(err).__name__}): a "
            "garbled header, or a message larger than this device's free memory"
        ) from None


def wire_buffer(like: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """An uninitialised tensor shaped as ``like`` on ``wire``: pinned host memory when
    ``like`` is on CUDA and ``wire`` is the host (so copies to and from it are DMAs)."""
    pinned = wire.type == "cpu" and like.device.type == "cuda"
    return torch.empty(like.shape, dtype=like.dtype, device=wire, pin_memory=pinned)


def to_wire(tensor: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """``tensor`` where the backend moves bytes (``wire``): itself when it is there already,
    else a copy -- in pinned host memory when staging a CUDA tensor for Gloo, so that the
    copy is a DMA and the send reads it at once (issue 15 item 5: compute on CUDA,
    communication over Gloo). The copy is finished when this returns."""
    if tensor.device == wire:
        return tensor.contiguous()
    staged = wire_buffer(tensor, wire)
    staged.copy_(tensor)
    return staged


def from_wire(received: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What arrived on the wire, on the compute ``device``: itself when it is there, else a
    copy (asynchronous from pinned memory: later work on ``device``'s stream is ordered
    after it)."""
    if received.device == device:
        return received
    return received.to(device, non_blocking=received.is_pinned())


def land(target: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Copy what arrived on the wire into ``target`` on the compute device (asynchronous
    from pinned memory, as `from_wire`); returns ``target``."""
    if received is not target:
        target.copy_(received, non_blocking=received.is_pinned())
    return target


class StagedWork:
    """A collective run on a wire copy of a compute-device tensor: waiting for it copies the
    result back (see [Note: compute device and wire device] in parallelism/devices.py).
    Anything else is the backend work's own."""

    def __init__(self, work: dist.Work, staged: torch.Tensor, target: torch.Tensor) -> None:
        self._work = work
        self._staged = staged
        self._target = target
        self._landed = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for the collective (at most ``timeout``: the backend raises when it runs
        out), then copy the result into the compute-device tensor, once."""
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._landed:
            land(self._target, self._staged)
            self._landed = True
        return bool(done)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


Waitable = dist.Work | StagedWork
"""What a started collective returns: the backend's work, or a staged one."""


def pack_activation_header(tensor: torch.Tensor, tuple_size: int) -> torch.Tensor:
    """The header sent ahead of ``tensor`` (on the host): its dims, dtype code, the size of
    the tuple it belongs to (0: a lone tensor), whether it requires a gradient, its shape.

    Raises:
        ValueError: if ``tensor`` is not a tensor, has more than 8 dims or a dtype that
            cannot be sent.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"a stage must return a tensor or a tuple of tensors, got {type(tensor).__name__}"
        )
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"cannot send a tensor of {tensor.dim()} dims (max {_MAX_DIMS})")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send dtype {tensor.dtype}; supported: {_DTYPES}")
    header = torch.zeros(ACTIVATION_HEADER_LEN, dtype=torch.int64)
    header[0] = tensor.dim()
    header[1] = _DTYPES.index(tensor.dtype)
    header[2] = tuple_size
    header[3] = int(tensor.requires_grad)
    header[4 : 4 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def unpack_activation_header(
    meta: list[int], first_size: int | None, src: int
) -> tuple[list[int], torch.dtype, int, bool]:
    """The shape, dtype, tuple size and requires-grad flag a received header announces.
    ``first_size``: the tuple size the first header of this activation announced (every
    header of a tuple announces the same), None for the first.

    Raises:
        GarbledMessage: if a field is out of bounds -- checked before anything is allocated:
            after an abort the buffer holds garbage.
    """
    ndim, code, size, grad = meta[:4]
    shape = meta[4 : 4 + ndim]
    if not (
        0 <= ndim <= _MAX_DIMS
        and 0 <= code < len(_DTYPES)
        and 0 <= size <= MAX_TUPLE
        and grad in (0, 1)
        and all(0 <= d <= _MAX_ELEMENTS for d in shape)
        and math.prod(shape) <= _MAX_ELEMENTS
        and (first_size is None or size == first_size)
    ):
        raise GarbledMessage(f"an activation header {meta} from rank {src}")
    return shape, _DTYPES[code], size, bool(grad)
