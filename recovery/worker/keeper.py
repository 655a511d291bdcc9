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

from parallelism.comm import GarbledMessage, StageComm
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
        self._digested = threading.Event()
        """Set once the newest own copy's digests are recorded (or failed)."""
        self._digested.set()

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
    ) -> None:
        """Keep a packed copy of ``rank``'s state (at its step); swap copies with buddy and ward.

        The copy is packed now (so the next step cannot leak into it); its digests (always
        recorded: `PackedState.corrupted` checks a copy before it is restored, see [Note:
        checked transfers]) and the swap run on a background thread -- over the side
        group -- overlapped with training, so that the caller waits for neither the hash
        nor, on a GPU, the copy to host memory.
        """
        self.join_exchange()
        packed = pack_state(state)
        step = packed.step
        self.peer.put(step, rank, packed)
        swap = comm is not None and buddy is not None and ward is not None and buddy != rank
        with self._lock:
            self._round += 1
            round_ = self._round
        self._digested = digested = threading.Event()
        self._exchange = threading.Thread(
            target=self._digest_and_swap,
            args=(comm if swap else None, step, rank, packed, buddy, ward, round_, digested),
            name="peer-snapshot",
            daemon=True,
        )
        self._exchange.start()

    def held(self, step: int, rank: int, timeout: float = 60.0) -> PackedState:
        """The copy of ``rank`` at ``step`` held here, once the newest own copy's digests
        are recorded (waiting at most ``timeout`` seconds: a copy still without them is
        not trusted, see `PackedState.corrupted`).

        Raises:
            KeyError: if it is not held here.
        """
        self._digested.wait(timeout)
        return self.peer.get(step, rank)

    def _digest_and_swap(
        self,
        comm: StageComm | None,
        step: int,
        rank: int,
        packed: PackedState,
        buddy: int | None,
        ward: int | None,
        round_: int,
        digested: threading.Event,
    ) -> None:
        """Record the own copy's digests (in its place), then, given a ``comm``, send it
        to ``buddy`` and keep ``ward``'s."""
        try:
            own = packed.digested()  # waits for a copy from a GPU, then hashes
            with self._lock:  # the same bytes, now checkable -- if still held
                if _holds(self.peer, step, rank, packed):
                    self.peer.put(step, rank, own)
        except Exception as exc:  # the copy stays without digests, so it is never trusted
            log.warning("peer snapshot of step %d: its digests failed: %s", step, exc)
            return
        finally:
            digested.set()
        if comm is None or buddy is None or ward is None:
            return
        header = torch.frombuffer(bytearray(own.header()), dtype=torch.uint8)
        sizes = torch.tensor([header.numel(), own.nbytes], dtype=torch.int64)
        try:
            works = comm.side_isend([sizes, header, own.data], buddy)
            theirs = _checked_sizes(comm.side_recv(torch.empty(2, dtype=torch.int64), ward), ward)
            their_header = comm.side_recv(torch.empty(int(theirs[0]), dtype=torch.uint8), ward)
            data = comm.side_recv(torch.empty(int(theirs[1]), dtype=torch.uint8), ward)
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
        packed = self.held(step, ward).wait()
        header = torch.frombuffer(bytearray(packed.header()), dtype=torch.uint8)
        sizes = torch.tensor([header.numel(), packed.nbytes], dtype=torch.int64)
        for t in (sizes, header, packed.data):
            comm.isend(t.to(comm.wire), dst)
        comm.wait_sends()
        return int(header.numel() + packed.nbytes)

    def receive(self, comm: StageComm, src: int) -> PackedState:
        """The packed copy that ``src`` sends (`send`), on the CPU."""
        sizes = comm.recv(torch.empty(2, dtype=torch.int64, device=comm.wire), src).cpu()
        sizes = _checked_sizes(sizes, src)
        header = comm.recv(torch.empty(int(sizes[0]), dtype=torch.uint8, device=comm.wire), src)
        data = comm.recv(torch.empty(int(sizes[1]), dtype=torch.uint8, device=comm.wire), src)
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


def _holds(peer: PeerSnapshots, step: int, rank: int, packed: PackedState) -> bool:
    """Whether ``peer`` still holds exactly ``packed`` as ``rank``'s copy at ``step``."""
    try:
        return peer.get(step, rank) is packed
    except KeyError:
        return False


def _checked_sizes(sizes: torch.Tensor, src: int) -> torch.Tensor:
    """A peer copy's announced (header, data) sizes, checked before they are allocated."""
    header, data = (int(v) for v in sizes.tolist())
    if not (0 < header <= MAX_HEADER_BYTES and 0 <= data <= MAX_TENSOR_BYTES):
        raise GarbledMessage(f"a peer copy of {header} + {data} bytes announced by rank {src}")
    return sizes
