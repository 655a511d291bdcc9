"""The worker's snapshot calls: peer snapshots, durable snapshots and restart checkpoints.

`Snapshotting` is the part of `recovery.worker.StageWorker` that the controller calls to
take a snapshot, to hand one to a replacement, and to roll back to one. Each call is a
line or two over the worker's `recovery.worker.keeper.SnapshotKeeper`; the tiers are
described in `recovery.snapshots`, the ``restart`` baseline's checkpoints in
`recovery.snapshots.checkpoint`.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from parallelism.engine import StepStats
from parallelism.topology import Topology
from recovery.policy import Timeouts
from recovery.snapshots import unpack_state
from recovery.snapshots.checkpoint import load_checkpoint, save_checkpoint
from recovery.state import Progress
from recovery.worker.lifecycle import WorkerLifecycle
from recovery.worker.reports import StepReport

__all__ = ["Snapshotting"]

_SAVE_WAIT = Timeouts().within("save")
_HANG_WAIT = Timeouts().within("hang")
"""The waits of a caller that passes none: the default policy's (`Timeouts.within`)."""


class Snapshotting(WorkerLifecycle):
    """Taking, handing over and restoring snapshots and checkpoints.

    Owns no state of its own: the copies are the `SnapshotKeeper`'s (``snapshots``), and a
    restore rewrites the whole worker state (see [Note: one worker state]).
    """

    def _report(self, step: int, stats: StepStats) -> StepReport:
        """A ready report for ``step``: its measurements and the redundancy this worker
        holds (its peer copies, and the durable writes that finished -- or failed -- since
        the last one)."""
        done, failed = self.snapshots.finished_writes(self.rank)
        return StepReport(
            rank=self.rank,
            step=step,
            ok=True,
            stats=stats,
            snapshots=self.snapshots.holdings(),
            durable_done=done,
            durable_failed=failed,
        )

    def flush_snapshots(self, wait: timedelta = _SAVE_WAIT) -> StepReport:
        """Wait for durable writes and the peer exchange in flight, at most ``wait``
        (`Timeouts.within` the controller's wait on this call); report what is held."""
        self.snapshots.flush(wait)
        return self._report(self.step, StepStats())

    # -- peer memory ---------------------------------------------------------------------

    def take_snapshot(self, step: int, wait: timedelta = _HANG_WAIT) -> float:
        """Keep a packed copy of this worker's state at ``step`` and send one to the buddy.

        The copy is taken now (so the next step cannot leak into it); its digests, checked
        before it is restored, and the exchange with buddy and ward are taken on a
        background thread, overlapped with training. ``wait``: how long the previous
        exchange may still take (`Timeouts.within` the controller's wait on this call).
        Returns the seconds the caller was blocked.
        """
        start = time.perf_counter()
        assert step == self.step, (step, self.step)
        self.snapshots.take(
            self.rank, self.own_state(), self.comm, self.buddy, self.ward, wait=wait
        )
        return time.perf_counter() - start

    def restore_own(self, step: int) -> tuple[int, dict[int, list[str]]]:
        """Roll back to this worker's own peer snapshot of ``step``. Returns the step and
        the tensors found corrupted -- or not shown intact (then nothing is restored: see
        `PackedState.corrupted`)."""
        packed = self.snapshots.held(step, self.rank)
        bad = packed.corrupted()
        if bad:
            return self.step, {self.rank: list(bad)}
        self._rolled_back(unpack_state(packed, self.own_state()))
        return self.step, {}

    def send_snapshot(self, step: int, ward: int, dst: int) -> int:
        """Send the held snapshot of ``ward`` at ``step`` to ``dst`` (its replacement). Returns bytes."""
        assert self.comm is not None
        return self.snapshots.send(self.comm, step, ward, dst)

    def recv_snapshot(self, step: int, src: int) -> tuple[int, dict[int, list[str]]]:
        """Restore the snapshot of ``step`` that ``src`` holds for this rank. Returns the
        step and the tensors that arrived corrupted -- flipped in the holder's memory or on
        the way (then nothing is restored)."""
        assert self.comm is not None
        packed = self.snapshots.receive(self.comm, src)
        bad = packed.corrupted()
        if bad:
            return self.step, {src: list(bad)}
        self._rolled_back(unpack_state(packed, self.own_state()))
        self.snapshots.peer.put(step, self.rank, packed)
        return self.step, {}

    # -- the durable tier ----------------------------------------------------------------

    def sees_file(self, path: str, token: str) -> bool:
        """Whether ``path`` exists here and holds ``token``: the durable folder is shared
        with the driver (every worker writes its shard there, the driver commits)."""
        try:
            return Path(path).read_text() == token
        except OSError:
            return False

    def durable_write(self, root: str, step: int, wait: timedelta = _SAVE_WAIT) -> float:
        """Start writing this worker's state at ``step`` to the durable tier (asynchronously).

        Its completion shows in a later report's ``durable_done``. ``wait``: how long this
        worker's previous write may still take (`Timeouts.within` the controller's wait on
        this call); if it is still running then, this snapshot is skipped. Returns seconds
        blocked.
        """
        start = time.perf_counter()
        assert step == self.step, (step, self.step)
        self.snapshots.write_durable(root, self.rank, self.own_state(), wait)
        return time.perf_counter() - start

    def durable_load(self, root: str, step: int) -> int:
        """Load this worker's durable snapshot of ``step``. Returns the step.

        Raises:
            SnapshotCorrupted: if its files do not match their checksums (nothing loaded).
        """
        self._rolled_back(self.snapshots.load_durable(root, step, self.rank, self.own_state()))
        return self.step

    def durable_reshard(self, root: str, step: int, stages: int, replicas: int) -> int:
        """Load this worker's part of the durable snapshot of ``step`` that a job of
        ``stages`` x ``replicas`` wrote: its tensors by name (see [Note: resharding a
        snapshot] in recovery/snapshots/reshard.py). Returns the step.

        Raises:
            SnapshotCorrupted: if a file read fails its checksum.
            ValueError: if the snapshot does not hold this stage's tensors exactly once, or
                mixes CheckFree rebuild marks in this stage.
        """
        old = Topology(stages=stages, replicas=replicas)
        progress = self.snapshots.load_resharded(
            root, step, old, self.own_state(), self._reshard_rows()
        )
        self._rolled_back(progress)
        return self.step

    def _reshard_rows(self) -> list[tuple[int, int]] | None:
        """The table rows a reshard gathers by row range (a table worker's shard); None."""
        return None

    def _rolled_back(self, progress: Progress) -> None:
        """After restoring a snapshot's module and optimizer state: take its progress (a
        rebuild's mark with it, or none) and forget every newer snapshot and durable write
        (another timeline)."""
        self.progress = progress
        self.digests_ahead = None
        self.snapshots.peer.discard_after(progress.step)
        self.snapshots.forget_writes_after(progress.step)

    # -- restart checkpoints (the baseline) ----------------------------------------------

    def save_checkpoint(self, root: str, step: int) -> float:
        """Write this worker's state to a checkpoint (the ``restart`` baseline). Returns seconds."""
        start = time.perf_counter()
        assert step == self.step, (step, self.step)
        save_checkpoint(root, self.rank, self.own_state())
        return time.perf_counter() - start

    def load_checkpoint(self, root: str, step: int) -> int:
        """Load this worker's checkpoint of ``step``. Returns the step."""
        self.progress = load_checkpoint(root, self.rank, step, self.own_state())
        return self.step
