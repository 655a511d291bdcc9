"""What the embedding exchange needs from the workers' communication (`Collective`: an
all-to-all of variable-size tensors and an all-reduce), implemented twice: `LocalGroup`
(W workers as threads of one process, for tests and experiments) and
`ProcessGroupCollective` (a ``torch.distributed`` Gloo or NCCL process group).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from parallelism.checks import check_positive_int
from parallelism.errors import talks

__all__ = ["Collective", "LocalGroup", "ProcessGroupCollective"]


class Collective(Protocol):
    """What the embedding exchange needs from the workers' communication.

    Every worker of the group calls each method in the same order (a collective).
    """

    rank: int
    world_size: int

    def all_to_all(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Send ``tensors[d]`` to rank ``d``; return what each rank ``s`` sent here.

        The tensors may differ in dim 0 but share dtype and trailing dims across ranks.
        The returned tensors are this worker's own (they may be modified).
        """
        ...

    def all_reduce_sum(self, tensor: Tensor) -> None:
        """Replace ``tensor`` with the sum over ranks; every rank gets identical values."""
        ...


class LocalGroup:
    """``world_size`` workers that are threads of this process, meeting at a barrier.

    ``collective(rank)`` is rank ``rank``'s `Collective`. Every wait is bounded by
    ``timeout``; if one worker fails, `abort` wakes the others with
    ``threading.BrokenBarrierError`` instead of leaving them blocked.
    """

    def __init__(self, world_size: int, *, timeout: datetime.timedelta) -> None:
        check_positive_int("world_size", world_size)
        self.world_size = world_size
        self._timeout = timeout.total_seconds()
        self._barrier = threading.Barrier(world_size, timeout=self._timeout)
        self._slots: list[Any] = [None] * world_size

    def collective(self, rank: int) -> _LocalCollective:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        return _LocalCollective(self, rank)

    def abort(self) -> None:
        """Wake every waiting worker with ``BrokenBarrierError``."""
        self._barrier.abort()

    def reset(self) -> None:
        """Make the group usable again after `abort` (call when no worker is waiting)."""
        self._barrier.reset()
        self._slots = [None] * self.world_size

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        seen = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return seen


class _LocalCollective:
    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_to_all(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        if len(tensors) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} tensors, got {len(tensors)}")
        seen = self.group._exchange(self.rank, [t.detach() for t in tensors])
        return [sent[self.rank].clone() for sent in seen]

    def all_reduce_sum(self, tensor: Tensor) -> None:
        seen = self.group._exchange(self.rank, tensor.detach().clone())
        total = seen[0].clone()
        for part in seen[1:]:  # the same order on every rank: identical sums
            total += part
        tensor.copy_(total)


class ProcessGroupCollective:
    """A `Collective` over a ``torch.distributed`` process group object.

    ``group`` is a backend process group (``ProcessGroupGloo`` or ``ProcessGroupNCCL``)
    used directly, as `parallelism.comm.StageComm` builds them: ``alltoall_base`` for the
    exchange (sizes first, then the data) and ``allreduce`` for the sums. Every wait is
    bounded by ``timeout``; a dead peer surfaces as a `parallelism.errors.CommError` (the
    backend's error its cause).
    """

    def __init__(self, group: Any, *, timeout: datetime.timedelta) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.world_size = int(group.size())
        self.timeout = timeout

    @talks
    def all_to_all(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        w = self.world_size
        if len(tensors) != w:
            raise ValueError(f"all_to_all needs {w} tensors, got {len(tensors)}")
        trailing = tuple(tensors[0].shape[1:])
        if any(tuple(t.shape[1:]) != trailing or t.dtype != tensors[0].dtype for t in tensors):
            raise ValueError("all_to_all tensors must share dtype and trailing dims")
        device = tensors[0].device
        send_counts = torch.tensor([int(t.shape[0]) for t in tensors], dtype=torch.int64)
        recv_counts = torch.empty(w, dtype=torch.int64, device=device)
        opts = dist.AllToAllOptions()
        self._wait(
            self.group.alltoall_base(recv_counts, send_counts.to(device), [1] * w, [1] * w, opts)
        )
        splits_in = [int(c) for c in recv_counts.cpu()]
        send = torch.cat([t.detach().contiguous() for t in tensors])
        recv = torch.empty((sum(splits_in), *trailing), dtype=send.dtype, device=device)
        self._wait(self.group.alltoall_base(recv, send, splits_in, send_counts.tolist(), opts))
        return list(recv.split(splits_in))

    @talks
    def all_reduce_sum(self, tensor: Tensor) -> None:
        self._wait(self.group.allreduce([tensor]))

    def _wait(self, work: Any) -> None:
        work.wait(self.timeout)
