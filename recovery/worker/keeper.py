"""The snapshots one worker holds: its own and its ward's peer copies, the background
exchange that swaps them with its buddy, and its durable writes in flight.

`SnapshotKeeper` knows nothing of the worker that owns it: the module, optimizer and
process groups come in as arguments, so each of the worker's snapshot calls
(`recovery.worker.snapshots`) is a line or two over it. The tiers themselves -- packing,
the peer store, the checksummed durable store -- are `recovery.snapshots`.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from parallelism.comm import GarbledMessage, ReceiveBudget, StageComm, empty_received
from recovery.snapshots import (
    DurableStore,
    PackedState,
    PeerSnapshots,
    WriteHandle,
    pack_state,
)
from recovery.state import Progress, WorkerState
from recovery.wire import MAX_HEADER_BYTES, MAX_TENSOR_BYTES

__all__ = ["SnapshotKeeper"]

log = logging.getLogger("checkfree")


class SnapshotKeeper:
    """One worker's snapshot holdings.

    Owns ``peer`` (the peer-memory copies: its own, and its ward's), the thread that
    exchanges a new copy with buddy and ward over the side group, the durable store and
    the durable writes still in flight.
    """

    def __init__(self) -> None:
        self.peer = PeerSnapshots(keep=2)
        self._durable: DurableStore | None = None
        self._writes: dict[int, WriteHandle] = {}
        self._exchange: threading.Thread | None = None
        self._lock = threading.Lock()
        self._round = 0
        """The current exchange's number: a copy arriving from an older one is dropped."""

    def forget_peers(self) -> None:
        """Drop every peer copy (a worker set up afresh holds none)."""
        self.peer = PeerSnapshots(keep=2)

    def close(self) -> None:
        """Drop everything: the durable store, its writes in flight, every peer copy."""
        if self._durable is not None:
            self._durable.close()
            self._durable = None
        self._writes = {}
        self.peer = PeerSnapshots(keep=2)

    def holdings(self) -> dict[int, list[int]]:
        """The peer copies held: rank -> steps."""
        return {rank: sorted(steps) for rank, steps in self.peer.holdings().items()}

    def finished_writes(self, rank: int) -> list[int]:
        """The steps whose durable write finished since the last call. A write that failed
        is logged and forgotten: that snapshot never completes, and training goes on."""
        done = []
        for s in sorted(s for s, h in self._writes.items() if h.done()):
            try:
                self._writes.pop(s).result()
                done.append(s)
            except Exception as exc:
                log.warning("durable snapshot of step %d failed on rank %d: %s", s, rank, exc)
        return done

    def flush(self) -> None:
        """Wait for the durable writes in flight and for the peer exchange."""
        if self._durable is not None:
            for handle in list(self._writes.values()):
                with contextlib.suppress(Exception):
                    self._durable.wait(handle)
        self.join_exchange()

    # -- peer memory ---------------------------------------------------------------------

    def take(
        self,
        rank: int,
        state: WorkerState,
        comm: StageComm | None,
        buddy: int | None,
        ward: int | None,
        digests: bool = False,
    ) -> None:
        """Keep a packed copy of ``rank``'s state (at its step); swap copies with buddy and ward.

        The copy is packed now (so the next step cannot leak into it); the swap runs on a
        background thread over the side group, overlapped with training. ``digests``:
        record the fingerprint it is taken with (`PackedState.corrupted` checks it).
        """
        self.join_exchange()
        packed = pack_state(state, digests=digests)
        step = packed.step
        self.peer.put(step, rank, packed)
        if comm is not None and buddy is not None and ward is not None and buddy != rank:
            with self._lock:
                self._round += 1
                round_ = self._round
            self._exchange = threading.Thread(
                target=self._swap,
                args=(comm, step, packed, buddy, ward, round_),
                name="peer-snapshot",
                daemon=True,
            )
            self._exchange.start()

    def _swap(
        self, comm: StageComm, step: int, packed: PackedState, buddy: int, ward: int, round_: int
    ) -> None:
        header = torch.frombuffer(bytearray(packed.header()), dtype=torch.uint8)
        sizes = torch.tensor([header.numel(), packed.nbytes], dtype=torch.int64)
        try:
            packed.wait()  # a copy from a GPU may still be in flight (this thread waits)
            works = comm.side_isend([sizes, header, packed.data], buddy)
            sized = comm.side_recv(torch.empty(2, dtype=torch.int64), ward)
            their_header, data = _buffers(sized, torch.device("cpu"), ward)
            comm.side_recv(their_header, ward)
            comm.side_recv(data, ward)
            copy = PackedState.from_parts(their_header.numpy().tobytes(), data)
            with self._lock:  # the ward's copy is whole, whatever becomes of ours
                if round_ == self._round:  # (an exchange given up keeps nothing)
                    self.peer.put(step, ward, copy)
            comm.side_wait(works)
        except Exception:  # the generation ended under us: the snapshot is simply incomplete
            return

    def join_exchange(self, timeout: float = 60.0) -> None:
        """Wait (at most ``timeout`` seconds) for the peer exchange in flight, if any. One
        still running then is given up: a copy it receives later is dropped, not kept (it
        could be of a timeline a rollback has left meanwhile)."""
        if self._exchange is not None:
            self._exchange.join(timeout=timeout)
            if self._exchange.is_alive():
                with self._lock:
                    self._round += 1
            self._exchange = None

    def send(self, comm: StageComm, step: int, ward: int, dst: int) -> int:
        """Send the held copy of ``ward`` at ``step`` to ``dst`` over the main group.
        Returns bytes sent."""
        packed = self.peer.get(step, ward).wait()
        header = torch.frombuffer(bytearray(packed.header()), dtype=torch.uint8)
        sizes = torch.tensor([header.numel(), packed.nbytes], dtype=torch.int64)
        for t in (sizes, header, packed.data):
            comm.isend(t.to(comm.wire), dst)
        comm.wait_sends()
        return int(header.numel() + packed.nbytes)

    def receive(self, comm: StageComm, src: int) -> PackedState:
        """The packed copy that ``src`` sends (`send`), on the CPU."""
        sizes = comm.recv(torch.empty(2, dtype=torch.int64, device=comm.wire), src)
        header, data = _buffers(sizes, comm.wire, src)
        comm.recv(header, src)
        comm.recv(data, src)
        return PackedState.from_parts(header.cpu().numpy().tobytes(), data.cpu())

    # -- the durable tier ----------------------------------------------------------------

    def write_durable(self, root: str, rank: int, state: WorkerState) -> None:
        """Start writing ``rank``'s state (at its step) under ``root`` (asynchronously); its
        completion shows in a later `finished_writes`."""
        if self._durable is None or str(self._durable.root) != str(root):
            self._durable = DurableStore(root)
        self._writes[state.step] = self._durable.write(rank, state)

    def load_durable(self, root: str, step: int, rank: int, state: WorkerState) -> Progress:
        """Load ``rank``'s durable snapshot of ``step`` from ``root`` into ``state``,
        forgetting the writes in flight. Returns the progress it holds.

        Raises:
            SnapshotCorrupted: if its files do not match their checksums (nothing loaded).
        """
        if self._durable is not None:
            self._durable.close()
        self._writes = {}
        self._durable = DurableStore(root)
        return self._durable.load(step, rank, state)


def _buffers(sizes: torch.Tensor, device: torch.device, src: int) -> tuple[torch.Tensor, ...]:
    """The buffers for a peer copy's announced (header, data) sizes, checked before they are
    allocated: each in its bounds, both within one message's budget.

    Raises:
        GarbledMessage: for sizes out of bounds or over the budget.
    """
    header, data = (int(v) for v in sizes.tolist())
    what = f"a peer copy of {header} + {data} bytes announced by rank {src}"
    if not (0 < header <= MAX_HEADER_BYTES and 0 <= data <= MAX_TENSOR_BYTES):
        raise GarbledMessage(what)
    budget = ReceiveBudget(device)
    return tuple(empty_received((n,), torch.uint8, device, what, budget) for n in (header, data))
