"""`StateTransport`: one way of moving a worker's whole state to a peer of its generation.

Two ways implement it: `ProcessGroupTransport` sends the tensors over the process group
(Gloo or NCCL), and `SameHostTransport` lets a receiver on the sender's host copy them
straight out of the sender's memory, falling back to the process group when it cannot
([Note: same-host transfer] in recovery/transport/same_host.py). Both send the same
description first and check what arrives against the sender's digests ([Note: checked
transfers] in recovery/transport/process_group.py); one conformance test runs over both
(tests/test_transport.py).

A transport adds no clock of its own: its waits are the process group's, which the
controller's ``transfer`` timeout bounds, with c10d's own timeout behind it
(docs/timeouts.md).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from parallelism.comm import StageComm
from recovery.state import Progress, WorkerState

if TYPE_CHECKING:
    from recovery.transport.process_group import DigestsAhead

__all__ = ["StateTransport"]


class StateTransport(abc.ABC):
    """Moves a `WorkerState` -- every part of it (see [Note: one worker state] in
    recovery/state.py) -- between two ranks of ``comm``'s generation."""

    def __init__(self, comm: StageComm) -> None:
        self.comm = comm

    @abc.abstractmethod
    def send(
        self,
        dst: int,
        state: WorkerState,
        *,
        flip: int | None = None,
        ahead: DigestsAhead | None = None,
    ) -> int:
        """Send ``state`` to global rank ``dst``; returns the bytes sent.

        ``flip`` (a seed): the injected fault, one bit flipped in flight after the digests
        were taken. ``ahead``: the digests of ``state``, if taken already (used only if
        they still describe it; see [Note: digests taken ahead]).

        Raises:
            ConnectionError: or a communication error (`recovery.worker.is_comm_error`),
                if the peer died or the groups were closed.
        """

    @abc.abstractmethod
    def recv(self, src: int, state: WorkerState) -> tuple[Progress, int]:
        """Replace ``state``'s module and optimizer state with what global rank ``src``
        sends; returns the sender's progress (for the caller to adopt) and the bytes
        received.

        Raises:
            RuntimeError: if the source's module does not match this worker's (a different
                stage or model), before any parameter is overwritten.
            GarbledMessage: if the description is not one a transport sends.
            TransferCorrupted: if what arrived differs from the sender's digests; the
                optimizer state is then left as it was, the parameters are not to be trusted.
            ConnectionError: or a communication error (`recovery.worker.is_comm_error`),
                if the peer died or the groups were closed.
        """
