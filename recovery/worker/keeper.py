"""The snapshots one worker holds: its own and its ward's peer copies, the background
exchange that swaps them with its buddy, and its durable writes in flight.

`SnapshotKeeper` knows nothing of the worker that owns it: the module, optimizer and
process groups come in as arguments, so each of the worker's snapshot calls
(`recovery.worker.snapshots`) is a line or two over it. The tiers themselves -- packing,
the peer store, the checksummed durable store -- are `recovery.snapshots`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from parallelism.comm import GarbledMessage, ReceiveBudget, StageComm, empty_received
from parallelism.topology import Topology
from recovery.snapshots import (
    DurableStore,
    PackedState,
    PeerSnapshots,
    WriteHandle,
    pack_state,
)
from recovery.snapshots.reshard import load_resharded, load_resharded_tables
from recovery.state import Progress, WorkerState
from recovery.wire import MAX_HEADER_BYTES, MAX_TENSOR_BYTES

__all__ = ["SnapshotKeeper"]

log = logging.getLogger("checkfree")

_WRITES_AT_CLOSE = timedelta(seconds=2)
"""How long `SnapshotKeeper.close` waits for durable writes in flight: a worker reset at the
end of a job is given 5 s after a failure (``RayWorkerGroup.shutdown``); the job's own end
flushed them already."""


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
        self._failed: dict[int, str] = {}
        """Durable snapshot step -> why this worker's write of it failed (not yet reported)."""
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

    def close(self, wait: timedelta = _WRITES_AT_CLOSE) -> None:
        """Drop everything: the durable store, its writes in flight (waited for at most
        ``wait``, then left to finish in the background), every peer copy."""
        self._drop_store(wait)
        self.peer = PeerSnapshots(keep=2)

    def _drop_store(self, wait: timedelta) -> None:
        store, self._durable, self._writes, self._failed = self._durable, None, {}, {}
        if store is None:
            return
        try:
            store.close(wait)
        except TimeoutError as exc:
            log.warning("%s: left to finish in the background", exc)
            store.abandon()

    def holdings(self) -> dict[int, list[int]]:
        """The peer copies held: rank -> steps."""
        return {rank: sorted(steps) for rank, steps in self.peer.holdings().items()}

    def finished_writes(self, rank: int) -> tuple[list[int], dict[int, str]]:
        """The steps whose durable write finished since the last call, and those whose
        write failed (step -> why). A failed write is logged: that snapshot is skipped, and
        training goes on."""
        done = []
        for s in sorted(s for s, h in self._writes.items() if h.done()):
            try:
                self._writes.pop(s).result()
                done.append(s)
            except Exception as exc:
                self._fail(s, rank, exc)
        failed, self._failed = self._failed, {}
        return done, failed

    def _fail(self, step: int, rank: int, exc: BaseException) -> None:
        log.warning("durable snapshot of step %d skipped on rank %d: %s", step, rank, exc)
        self._failed[step] = f"rank {rank}: {type(exc).__name__}: {exc}"

    def forget_writes_after(self, step: int) -> None:
        """After a rollback to ``step``: the durable writes of later steps belong to the
        timeline left behind. They are never reported (they land, or fail, unseen); a step
        run again is written again."""
        self._writes = {s: h for s, h in self._writes.items() if s <= step}
        self._failed = {s: why for s, why in self._failed.items() if s <= step}

    def flush(self, wait: timedelta) -> None:
        """Wait for the durable writes in flight and for the peer exchange, at most ``wait``
        in all. A write still running then is reported when it finishes, by a later
        `finished_writes`; an exchange still running is given up (`join_exchange`)."""
        deadline = time.monotonic() + wait.total_seconds()
        futures = [h.future for h in self._writes.values()]
        _, running = concurrent.futures.wait(futures, timeout=wait.total_seconds())
        if running:
            log.warning(
                "%d durable write(s) still running after %s; not waiting longer",
                len(running),
                wait,
            )
        self.join_exchange(max(0.0, deadline - time.monotonic()))

    # -- peer memory ---------------------------------------------------------------------

    def take(
        self,
        rank: int,
        state: WorkerState,
        comm: StageComm | None,
        buddy: int | None,
        ward: int | None,
        *,
        wait: timedelta,
    ) -> None:
        """Keep a packed copy of ``rank``'s state (at its step); swap copies with buddy and ward.

        The copy is packed now (so the next step cannot leak into it); its digests (always
        recorded: `PackedState.corrupted` checks a copy before it is restored, see [Note:
        checked transfers]) and the swap run on a background thread -- over the side
        group -- overlapped with training, so that the caller waits for neither the hash
        nor, on a GPU, the copy to host memory. ``wait``: how long the previous exchange may
        still take (then it is given up).
        """
        self.join_exchange(wait.total_seconds())
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
        packed = self.held(step, ward).wait()
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

    def write_durable(self, root: str, rank: int, state: WorkerState, wait: timedelta) -> None:
        """Start writing ``rank``'s state (at its step) under ``root`` (asynchronously); its
        completion shows in a later `finished_writes`. ``wait``: how long this rank's
        previous write may still take. If it is still running then, or the write cannot
        start (the folder is gone, read-only, full...), this snapshot is skipped: logged,
        reported by the next `finished_writes`, and training goes on."""
        try:
            self._store(root, wait)
            assert self._durable is not None
            self._writes[state.step] = self._durable.write(rank, state, timeout=wait)
        except OSError as exc:  # TimeoutError and FileExistsError included
            self._fail(state.step, rank, exc)

    def load_durable(self, root: str, step: int, rank: int, state: WorkerState) -> Progress:
        """Load ``rank``'s durable snapshot of ``step`` from ``root`` into ``state``,
        forgetting the writes in flight: they are of the timeline left behind, and are not
        waited for (the store's next write of this rank waits for them). Returns the
        progress it holds.

        Raises:
            SnapshotCorrupted: if its files do not match their checksums (nothing loaded).
        """
        self._store(root, timedelta(0))
        assert self._durable is not None
        self._writes = {}
        return self._durable.load(step, rank, state)

    def load_resharded(
        self, root: str, step: int, old: Topology, state: WorkerState, rows: Any = None
    ) -> Progress:
        """`load_durable` from the snapshot of a job of topology ``old`` (another cut or
        replica count): ``state``'s tensors by name (`recovery.snapshots.reshard`), a
        table worker's ``rows`` by row range. Returns the progress to adopt.

        Raises:
            SnapshotCorrupted: if a file read fails its checksum.
            ValueError: if the snapshot does not hold this stage's tensors exactly once.
        """
        self._store(root, timedelta(0))
        assert self._durable is not None
        self._writes = {}
        if rows is not None:
            return load_resharded_tables(self._durable, step, old, state, rows)
        return load_resharded(self._durable, step, old, state)

    def _store(self, root: str, wait: timedelta) -> None:
        """The durable store of ``root`` (another folder's is dropped, its writes in flight
        waited for at most ``wait``)."""
        if self._durable is None or str(self._durable.root) != str(root):
            self._drop_store(wait)
            self._durable = DurableStore(root)


def _holds(peer: PeerSnapshots, step: int, rank: int, packed: PackedState) -> bool:
    """Whether ``peer`` still holds exactly ``packed`` as ``rank``'s copy at ``step``."""
    try:
        return peer.get(step, rank) is packed
    except KeyError:
        return False


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
