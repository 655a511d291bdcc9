"""Snapshots and checkpoints as the controller schedules them: when to take them, when a
durable snapshot is complete, and resuming from the newest intact one after the driver died.

The copies themselves are made by the workers (recovery/snapshots/); what exists is booked
in the `RedundancyLedger`. This module decides nothing about recovery.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.errors import RecoveryError, SnapshotCorrupted
from recovery.groups.group import WorkerGroup, WorkerMethod, require
from recovery.names import Mode
from recovery.policy import RecoveryPolicy
from recovery.rundir import FolderLock
from recovery.runtime.executor import Restore
from recovery.runtime.ledger import RedundancyLedger
from recovery.snapshots import DurableStore, SnapshotFolder
from recovery.snapshots.identity import job_identity
from recovery.snapshots.reshard import check_reshard
from recovery.worker import StageWorker, StepReport

__all__ = ["Persistence", "SkippedSnapshot", "claim_snapshot_folder"]

log = logging.getLogger("checkfree")

RUN_OF_FAILURES = 3
"""Durable snapshots skipped in a row from which each one is logged as an error."""


@dataclass(frozen=True)
class SkippedSnapshot:
    """A durable snapshot that could not be written or committed, and was skipped."""

    step: int
    error: str
    """What failed: a rank's write (``"rank 3: OSError: ..."``) or the commit."""
    in_a_row: int
    """Snapshots skipped in a row, this one included (since the last complete one)."""
    at: float
    """When (``time.time()``)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def claim_snapshot_folder(
    policy: RecoveryPolicy, snapshot_dir: str | None, *, resume: bool
) -> FolderLock | None:
    """Lock the durable snapshot folder for this job's life, if the policy takes durable
    snapshots (call it before any worker starts; `FolderLock.release` at the end). A job
    that starts afresh (not ``resume``) is refused a folder that holds complete snapshots:
    its own would land on them (`DurableStore.write` refuses a complete step).

    Raises:
        ValueError: if the policy takes durable snapshots and there is no folder, or a job
            that starts afresh is given one with complete snapshots (naming the folder and
            how to go on).
        FolderInUse: if another job holds the folder, naming it.
    """
    if policy.snapshots.durable_every is None:
        return None
    if not snapshot_dir:
        raise ValueError(
            "snapshots.durable_every needs a snapshot folder: set snapshots.dir or a run folder"
        )
    lock = FolderLock(snapshot_dir, "snapshot folder").acquire()
    steps = [] if resume else SnapshotFolder(snapshot_dir).steps()
    if steps:
        lock.release()
        shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
        raise ValueError(
            f"the snapshot folder {snapshot_dir} holds durable snapshots (steps {shown}), and "
            'this job starts afresh (resume="never"): its snapshots would land on them. To '
            "start from scratch, move the folder away (or give this job another one); to go "
            'on from them, resume (resume="auto", or "reshard" on another topology)'
        )
    return lock


class Persistence:
    """The job's snapshot and checkpoint schedule (see the module docstring).

    Args:
        snapshot_dir: where durable snapshots go (needed when the policy sets
            ``snapshots.durable_every``).
        work_dir: where the restart baseline's checkpoints go (default: a temp folder).
    """

    def __init__(
        self,
        group: WorkerGroup,
        spec: TrainSpec,
        topology: Topology,
        policy: RecoveryPolicy,
        ledger: RedundancyLedger,
        *,
        snapshot_dir: str | None,
        work_dir: str | None,
    ) -> None:
        self.group = group
        self.spec = spec
        self.topology = topology
        self.policy = policy
        self.ledger = ledger
        self.snapshot_dir = snapshot_dir
        self.durable: DurableStore | None = None
        self.checkpoint_dir = ""
        if policy.strategy == Mode.RESTART:
            self.checkpoint_dir = str(
                policy.baseline.checkpoint_dir
                or work_dir
                or tempfile.mkdtemp(prefix="checkfree-ckpt-")
            )
        self._identity: dict[str, str] | None = None
        self.skipped: list[SkippedSnapshot] = []
        """Durable snapshots skipped because a write or the commit failed, in order."""
        self._in_a_row = 0
        self.timings: dict[str, list[float]] = {}
        """Seconds the job was blocked, per kind of work (checkpoint and snapshot writes)."""
        self.resharded_from: Topology | None = None
        """The layout whose durable snapshot this job resumed from, if it was another one."""

    def meta(self) -> dict[str, Any]:
        """What identifies this job in a durable snapshot: a re-run must match it to resume
        (the model, optimizer, data, schedule and loss as `recovery.snapshots.identity`
        describes them)."""
        if self._identity is None:
            self._identity = job_identity(self.spec)
        return {
            "topology": [self.topology.stages, self.topology.replicas],
            "spec": self.spec.name,
            "seed": self.spec.seed,
            "microbatches": self.spec.microbatches,
            **self._identity,
        }

    def restore_context(self, generation: int | None = None) -> Restore:
        """What the executor needs to carry out a plan (snapshots and checkpoints included)
        in ``generation``."""
        return Restore(
            generation=generation,
            group=self.group,
            topology=self.topology,
            spec=self.spec,
            policy=self.policy,
            ledger=self.ledger,
            timeout=self.policy.timeouts.transfer,
            durable=self.durable,
            snapshot_dir=self.snapshot_dir,
            checkpoint_dir=self.checkpoint_dir,
        )

    def _timed(self, name: str, start: float) -> None:
        self.timings.setdefault(name, []).append(time.perf_counter() - start)

    def _all(
        self, method: WorkerMethod[...], what: str, *args: Any, timeout: Any
    ) -> dict[int, Any]:
        got = self.group.call(method, args=lambda rank: args, timeout=timeout)
        require(got, what)
        return got.results

    # -- durable tier --------------------------------------------------------------------

    def open_durable(self, *, resume: bool, reshard: bool = False) -> int | None:
        """Open the durable tier; with ``resume``, load its newest intact snapshot into
        every worker -- with ``reshard`` also one another topology wrote, by parameter
        name (`resharded_from` then names it; see [Note: resharding a snapshot]). Returns
        the step resumed from, or None.

        Raises:
            ValueError: if there is no snapshot folder, its snapshots belong to another job
                or (without ``reshard``) another topology, or a reshard cannot be exact
                (`recovery.snapshots.reshard.check_reshard`).
            RecoveryError: if snapshots exist but none is intact.
        """
        if not self.snapshot_dir:
            raise ValueError(
                "snapshots.durable_every needs a snapshot folder: set snapshots.dir or a run folder"
            )
        self.durable = DurableStore(self.snapshot_dir)
        self._check_shared(self.snapshot_dir)
        if not resume:
            return None
        for step in self.durable.steps():
            # Whose snapshot it is comes first: another layout's or job's snapshot is not
            # damaged, and must not read as if it were (nor be skipped for an older one).
            try:
                written_by = self.durable.load_meta(step)
            except SnapshotCorrupted as exc:
                log.warning("durable snapshot of step %d is not intact, skipping it: %s", step, exc)
                continue
            old = self._check_layout(step, written_by.get("topology"), reshard=reshard)
            if old is not None:
                try:
                    return self._reshard(step, old)
                except SnapshotCorrupted as exc:
                    log.warning(
                        "durable snapshot of step %d is not intact, skipping it: %s", step, exc
                    )
                    continue
            self.durable.check_meta(step, self.meta())
            problems = self.durable.verify(step, self.topology.world_size)
            if problems:
                log.warning(
                    "durable snapshot of step %d is not intact, skipping it: %s",
                    step,
                    "; ".join(problems),
                )
                continue
            try:
                self._all(
                    StageWorker.durable_load,
                    f"resume from the durable snapshot of step {step}",
                    self.snapshot_dir,
                    step,
                    timeout=self.policy.timeouts.save,
                )
            except SnapshotCorrupted as exc:
                log.warning(
                    "durable snapshot of step %d is corrupted, trying an older one: %s", step, exc
                )
                continue
            self.durable.discard_after(step)
            self.ledger.durable_steps = [s for s in self.durable.steps() if s <= step]
            log.warning(
                "resumed from the durable snapshot of step %d in %s", step, self.snapshot_dir
            )
            return step
        if self.durable.steps():
            raise RecoveryError(
                f"no intact durable snapshot in {self.snapshot_dir}: every complete one has "
                "missing, truncated or altered files (see the log above for each); restore the "
                "folder from a copy, or move it away to start from scratch"
            )
        return None

    def _check_layout(self, step: int, theirs: object, *, reshard: bool) -> Topology | None:
        """The layout that wrote the durable snapshot of ``step`` (``theirs``: its
        ``[stages, replicas]``) if it is another one and ``reshard`` allows it; None for
        this job's own.

        Raises:
            ValueError: for another layout without ``reshard``, naming both layouts and
                what to do.
        """
        ours = [self.topology.stages, self.topology.replicas]
        if theirs == ours or not (isinstance(theirs, list) and len(theirs) == 2):
            return None  # a malformed entry is check_meta's to report
        if reshard:
            return Topology(stages=int(theirs[0]), replicas=int(theirs[1]))
        raise ValueError(
            f"the durable snapshot of step {step} in {self.snapshot_dir} was written by a job "
            f"of {_layout(*theirs)}, and this job is {_layout(*ours)}: a snapshot holds one "
            f"state per worker, so only the layout that wrote it can resume from it as it "
            f"is. Resume with Topology(stages={theirs[0]}, replicas={theirs[1]}), or on this "
            'layout with resume="reshard" (state by parameter name, the global batch kept), '
            "or start afresh with another run folder (the snapshots are intact and were left "
            "as they are)"
        )

    def _reshard(self, step: int, old: Topology) -> int:
        """Resume from the durable snapshot of ``step``, written by a job of ``old``:
        every worker gathers its state by name. The same job is required (its identity,
        but not its layout nor its microbatch count: a step's math does not depend on
        them); no older snapshot of the other layout is kept as a rollback point.

        Raises:
            ValueError: for another job, or a reshard that cannot be exact.
            SnapshotCorrupted: if the snapshot is not intact.
        """
        assert self.durable is not None
        check_reshard(self.spec, old, self.topology)
        same = {k: v for k, v in self.meta().items() if k not in ("topology", "microbatches")}
        self.durable.check_meta(step, same)
        problems = self.durable.verify(step, old.world_size)
        if problems:
            raise SnapshotCorrupted(
                f"the durable snapshot of step {step} ({_layout(old.stages, old.replicas)}) "
                f"to reshard is not intact: {'; '.join(problems)}"
            )
        self._all(
            StageWorker.durable_reshard,
            f"reshard the durable snapshot of step {step}",
            self.snapshot_dir,
            step,
            old.stages,
            old.replicas,
            timeout=self.policy.timeouts.save,
        )
        self.durable.discard_after(step)
        self.ledger.durable_steps = []
        self.resharded_from = old
        log.warning(
            "resumed from the durable snapshot of step %d in %s, resharded from %s to %s",
            step,
            self.snapshot_dir,
            _layout(old.stages, old.replicas),
            _layout(self.topology.stages, self.topology.replicas),
        )
        return step

    def _check_shared(self, root: str) -> None:
        """Refuse a durable folder some worker cannot see (several nodes, no shared file
        system): its shard would be written where no one can load it from.

        Raises:
            ValueError: naming the workers and their nodes.
        """
        token = secrets.token_hex(8)
        probe = Path(root) / f".shared-{token}"
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
        try:
            seen = self.group.call(
                StageWorker.sees_file,
                args=lambda rank: (str(probe), token),
                timeout=self.policy.timeouts.control,
            )
        finally:
            probe.unlink(missing_ok=True)
        require(seen, "check the durable snapshot folder")
        blind = sorted(rank for rank, ok in seen.results.items() if not ok)
        if blind:
            where = ", ".join(
                f"worker {self.topology.worker(r)} on node {self.group.info(r).node_id or '?'}"
                for r in blind
            )
            raise ValueError(
                f"durable snapshots need a folder the driver and every worker share, but "
                f"{where} cannot see {root} (several nodes without a shared file system?). "
                "Put snapshot_dir on a shared file system (NFS, a cluster volume), or turn "
                "durable snapshots off (snapshots.durable_every=None)"
            )

    def note(self, reports: Mapping[int, StepReport]) -> None:
        """Book what the workers report holding; mark complete the durable snapshots that
        every rank has finished writing, and prune old ones. A snapshot some rank could not
        write, or that cannot be committed, is skipped (`skipped`)."""
        done = self.ledger.note(reports)
        if self.durable is None:
            return
        for _, report in sorted(reports.items()):
            for step, why in sorted(report.durable_failed.items()):
                self._skip(step, why)
        for step in done:
            self._commit(step)

    def commit_landed(self) -> None:
        """Mark complete the durable snapshots whose every rank's files are on disk.

        A worker that died after its write landed never reported it; its manifest (renamed
        into place only when the write was whole) is the proof instead.
        """
        if self.durable is None:
            return
        for step in sorted(self.ledger.durable_writes):
            self._commit(step, landed=True)

    def _commit(self, step: int, *, landed: bool = False) -> None:
        """Commit the durable snapshot of ``step`` and prune old ones; skip it if it cannot
        be committed. ``landed``: a step not every rank reported (a rank folder not in
        place yet is no failure: it may land later)."""
        assert self.durable is not None
        try:
            self.durable.commit(step, self.topology.world_size, self.meta())
        except FileNotFoundError as exc:
            if landed:
                return
            self._skip(step, f"{type(exc).__name__}: {exc}")
            return
        except (OSError, SnapshotCorrupted) as exc:  # ENOSPC, EIO, ESTALE, a garbled manifest
            self._skip(step, f"{type(exc).__name__}: {exc}")
            return
        self.ledger.durable_writes.pop(step, None)
        self.ledger.durable_steps.append(step)
        self._in_a_row = 0
        try:
            removed = self.durable.prune(self.policy.snapshots.keep_durable, checksums=False)
        except OSError as exc:  # old snapshots stay; the next commit prunes again
            log.warning("could not prune the durable snapshots in %s: %s", self.snapshot_dir, exc)
            return
        self.ledger.durable_steps = [s for s in self.ledger.durable_steps if s not in removed]

    def _skip(self, step: int, error: str) -> None:
        """Give up the durable snapshot of ``step``: warn, and book it in `skipped`. The
        newest complete snapshot stays the durable tier's rollback point."""
        if not self.ledger.skip_durable(step):
            return  # another rank's failure of the same snapshot
        self._in_a_row += 1
        skipped = SkippedSnapshot(step=step, error=error, in_a_row=self._in_a_row, at=time.time())
        self.skipped.append(skipped)
        newest = max(self.ledger.durable_steps, default=None)
        what = (
            f"durable snapshot of step {step} in {self.snapshot_dir} skipped, training goes on "
            f"(the newest complete one is {'none' if newest is None else f'step {newest}'}): "
            f"{error}"
        )
        if self._in_a_row >= RUN_OF_FAILURES:
            log.error(
                "%s. %d durable snapshots in a row could not be written: is the folder full, "
                "read-only or gone?",
                what,
                self._in_a_row,
            )
        else:
            log.warning("%s", what)

    def flush(self) -> None:
        """At the end of a job: let durable writes in flight land and mark them complete,
        so that a re-run with more steps resumes from the end of this one."""
        if self.durable is None:
            return
        timeouts = self.policy.timeouts
        got = self.group.call(
            StageWorker.flush_snapshots,
            args=lambda rank: (timeouts.within("save"),),
            timeout=timeouts.save,
        )
        self.note(got.results)

    def initial_snapshot(self, step: int) -> None:
        """A peer snapshot of the state training starts from (``step``), when fingerprints
        are checked: a corruption found before the first scheduled snapshot can then roll
        back to it (see [Note: fingerprint vote] in recovery/integrity/fingerprint_vote.py)."""
        if self.policy.snapshots.peer_every and self.topology.world_size > 1:
            timeouts = self.policy.timeouts
            self._all(
                StageWorker.take_snapshot,
                "take the initial peer snapshots",
                step,
                timeouts.within("hang"),
                timeout=timeouts.hang,
            )

    # -- after each commit ---------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether `after_commit` has anything to take once ``step`` steps are committed."""
        return self._checkpoint_due(step) or self._peer_due(step) or self._durable_due(step)

    def _checkpoint_due(self, step: int) -> bool:
        return (
            self.policy.strategy == Mode.RESTART
            and step % self.policy.baseline.checkpoint_every == 0
        )

    def _peer_due(self, step: int) -> bool:
        every = self.policy.snapshots.peer_every
        return bool(every and self.topology.world_size > 1 and step % every == 0)

    def _durable_due(self, step: int) -> bool:
        every = self.policy.snapshots.durable_every
        return bool(
            every
            and self.durable is not None
            and step % every == 0
            and step not in self.ledger.durable_steps
        )

    def after_commit(self, step: int) -> None:
        """Take the checkpoint and snapshots due now that ``step`` steps are committed.

        Each call is waited on for its timeout, and told how long it may wait inside for
        the worker's own work in flight (`Timeouts.within`): a slow disk holds a durable
        write up to ``save``, never past it, and is never taken for a hang."""
        timeouts = self.policy.timeouts
        if self._checkpoint_due(step):
            start = time.perf_counter()
            self._all(
                StageWorker.save_checkpoint,
                f"checkpoint step {step}",
                self.checkpoint_dir,
                step,
                timeout=self.policy.timeouts.save,
            )
            self.ledger.checkpoint_steps.append(step)
            self._timed("checkpoint_write", start)
        if self._peer_due(step):
            start = time.perf_counter()
            # Each copy records its digests, checked before a restore ([Note: checked transfers]).
            self._all(
                StageWorker.take_snapshot,
                "take peer snapshots",
                step,
                timeouts.within("hang"),
                timeout=timeouts.hang,
            )
            self._timed("snapshot_write", start)
        if self._durable_due(step):
            start = time.perf_counter()
            self._all(
                StageWorker.durable_write,
                "start durable snapshots",
                self.snapshot_dir,
                step,
                timeouts.within("save"),
                timeout=timeouts.save,
            )
            self._timed("durable_write", start)
            self.ledger.durable_writes.setdefault(step, set())


def _layout(stages: int, replicas: int) -> str:
    """``"2 stages x 1 replica (2 workers)"``."""

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    return f"{count(stages, 'stage')} x {count(replicas, 'replica')} ({count(stages * replicas, 'worker')})"
