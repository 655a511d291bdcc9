"""The durable snapshot tier: each rank's state written asynchronously with DCP, checksummed.

Every ``snapshots.durable_every`` steps each worker writes its state with
torch.distributed.checkpoint (DCP) to a folder -- a shared filesystem on a real cluster --
asynchronously (`DurableStore.write`), with a checksummed manifest; the controller then
marks the step complete (`DurableStore.commit`). It survives anything, driver death
included: a re-run with the same run folder resumes from `DurableStore.newest_intact`.
Corrupted or missing files are found by checksum and never loaded (`SnapshotCorrupted`).
Which steps may be combined is [Note: snapshot consistency] (``recovery/snapshots/__init__.py``).

What is complete and intact, and commit and clean-up, are the controller's side
(`SnapshotFolder`, ``recovery/snapshots/folder.py``); this module adds the workers' side:
writing and loading. Durable layout (``rank_<r>`` as in ``recovery/snapshots/checkpoint.py``)::

    <root>/step_00000200/rank_0000.tmp/   a write in progress (never read)
    <root>/step_00000200/rank_0000/       .metadata, __0_0.distcp (DCP) + MANIFEST.json
    <root>/step_00000200/COMPLETE.json    world size, each rank's manifest digest, meta
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from parallelism.checks import check_index
from recovery.errors import SnapshotCorrupted
from recovery.snapshots.checkpoint import (
    checkpoint_path,
    fsync_dir,
    load_worker_state,
    step_path,
    write_json_atomic,
)
from recovery.snapshots.folder import (
    COMPLETE,
    FORMAT,
    HASH,
    MANIFEST,
    SnapshotFolder,
    file_digest,
)
from recovery.snapshots.reshard import renamed
from recovery.state import Progress, WorkerState, dcp_state

__all__ = [
    "COMPLETE",
    "DEFAULT_TIMEOUT",
    "FORMAT",
    "HASH",
    "MANIFEST",
    "DurableStore",
    "WriteHandle",
    "WriteResult",
    "file_digest",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class WriteResult:
    """A finished durable write of one rank's state."""

    step: int
    rank: int
    path: Path
    """The rank's folder, renamed into place."""
    bytes: int
    """Bytes of the files written (DCP data and metadata; the manifest excluded)."""
    blocked_s: float
    """Seconds `DurableStore.write` held the caller: DCP's staging copy of every tensor."""
    total_s: float
    """Seconds from the call to the rename into place: staging, the write (with fsync),
    the checksums and the manifest."""


@dataclass(frozen=True, eq=False)
class WriteHandle:
    """An in-flight durable write; `result` waits for it."""

    step: int
    rank: int
    blocked_s: float
    """Seconds `DurableStore.write` held the caller."""
    future: concurrent.futures.Future[WriteResult]

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: timedelta = DEFAULT_TIMEOUT) -> WriteResult:
        """Wait for the write to be in place.

        Raises:
            TimeoutError: if it is not done within ``timeout``.
            Exception: whatever the write raised (an ``OSError`` for a full disk, ...).
        """
        try:
            return self.future.result(timeout=timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"durable write of step {self.step}, rank {self.rank} not done after {timeout}"
            ) from None


class DurableStore(SnapshotFolder):
    """Durable snapshots under ``root``, written asynchronously with DCP.

    One instance per process: each worker writes its own rank's state with `write` and
    reads it back with `load`; the controller marks steps complete with `commit`, chooses
    one with `newest_intact` and cleans up with `prune` / `discard_after` (those are
    `SnapshotFolder`'s). See [Note: snapshot consistency].

    Args:
        root: the folder (a shared filesystem when workers run on several machines).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self._last: dict[int, WriteHandle] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Finishing a write (checksums, manifest, rename) runs here, off the caller's thread.
        self._finisher = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="durable-snapshot"
        )

    # -- writing (workers) ----------------------------------------------------------------

    def write(
        self,
        rank: int,
        state: WorkerState,
        *,
        info: Mapping[str, Any] | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> WriteHandle:
        """Start writing worker ``rank``'s whole state, under its step; return once it is
        staged.

        The caller is held only while DCP copies every tensor to fresh CPU memory (on a
        CPU worker that is a memory copy of the whole state); writing the files, fsync,
        checksumming and renaming ``rank_<r>.tmp`` to ``rank_<r>`` happen in background
        threads, while training goes on. At most one write per rank is in flight: a new
        one first waits for the previous one (whose outcome its own handle reports).

        Args:
            info: JSON-able facts recorded in the rank's manifest (stage, replica, ...).
            timeout: how long to wait for this rank's previous write.

        Raises:
            ValueError: for a negative rank, or ``info`` that is not JSON-able.
            FileExistsError: if ``step`` is already complete (after a rollback, call
                `discard_after` before snapshots of later steps are taken again).
            TimeoutError: if the previous write is not done within ``timeout``.
            RuntimeError: if the store was closed.
        """
        if self._closed:
            raise RuntimeError(f"durable store {self.root} is closed")
        step = state.step
        check_index("rank", rank)
        extra = dict(info or {})
        # A stage's names that are not the model's, for a reshard ([Note: resharding a snapshot]).
        names = renamed(state.module)
        if names:
            extra.setdefault("names", names)
        try:
            json.dumps(extra)
        except TypeError as exc:
            raise ValueError(f"info must be JSON-able: {exc}") from None
        previous = self._last.get(rank)
        if previous is not None:
            concurrent.futures.wait([previous.future], timeout=timeout.total_seconds())
            if not previous.done():
                raise TimeoutError(
                    f"durable write of step {previous.step}, rank {rank} still running after "
                    f"{timeout}; not starting the write of step {step}"
                )
        if (step_path(self.root, step) / COMPLETE).is_file():
            raise FileExistsError(
                f"durable snapshot of step {step} in {self.root} is already complete; after a "
                "rollback, discard_after(rollback step) must drop the abandoned timeline"
            )
        started = time.perf_counter()
        final = checkpoint_path(self.root, step, rank)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # Imported where used, as in checkpoint.py (~0.9 s of every worker start).
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        try:
            response = dcp.async_save(
                dcp_state(state),
                checkpoint_id=tmp,
                no_dist=True,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        blocked = time.perf_counter() - started
        future = self._finisher.submit(
            self._finish, upload, step, rank, tmp, final, extra, started, blocked
        )
        handle = WriteHandle(step=step, rank=rank, blocked_s=blocked, future=future)
        with self._lock:
            self._last[rank] = handle
        return handle

    def _finish(
        self,
        upload: concurrent.futures.Future[Any],
        step: int,
        rank: int,
        tmp: Path,
        final: Path,
        info: dict[str, Any],
        started: float,
        blocked: float,
    ) -> WriteResult:
        try:
            # DCP's writer thread (it fsyncs the files). Unbounded here, in the background;
            # whoever waits on the handle does so with a timeout.
            upload.result()
            files: dict[str, dict[str, Any]] = {}
            for path in sorted(tmp.iterdir()):
                if not path.is_file():
                    raise OSError(f"unexpected entry {path} in a DCP checkpoint")
                files[path.name] = {"size": path.stat().st_size, HASH: file_digest(path)}
            manifest = {
                "format": FORMAT,
                "step": step,
                "rank": rank,
                "hash": HASH,
                "files": files,
                "info": info,
                "host": socket.gethostname(),
                "torch": torch.__version__,
                "written_at": time.time(),
            }
            write_json_atomic(tmp / MANIFEST, manifest)
            shutil.rmtree(final, ignore_errors=True)  # an uncommitted older attempt
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return WriteResult(
            step=step,
            rank=rank,
            path=final,
            bytes=sum(int(f["size"]) for f in files.values()),
            blocked_s=blocked,
            total_s=time.perf_counter() - started,
        )

    def wait(self, handle: WriteHandle, timeout: timedelta = DEFAULT_TIMEOUT) -> WriteResult:
        """Wait for ``handle``'s write to be in place (what a worker reports to `commit`).

        Raises:
            TimeoutError: if it is not done within ``timeout``.
            Exception: whatever the write raised.
        """
        return handle.result(timeout)

    def pending(self) -> list[WriteHandle]:
        """The writes of this process still in flight."""
        with self._lock:
            return [h for h in self._last.values() if not h.done()]

    def close(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        """Wait for every write in flight (without raising their errors), then stop.

        Raises:
            TimeoutError: if some write is still running after ``timeout``.
        """
        with self._lock:
            futures = [h.future for h in self._last.values()]
        _, running = concurrent.futures.wait(futures, timeout=timeout.total_seconds())
        if running:
            raise TimeoutError(f"{len(running)} durable write(s) still running after {timeout}")
        self._closed = True
        self._finisher.shutdown(wait=True)

    def abandon(self) -> None:
        """Stop without waiting: no new write starts, and those in flight finish in the
        background (their snapshots are never committed by this store's caller)."""
        self._closed = True
        self._finisher.shutdown(wait=False)

    # -- loading (workers) ----------------------------------------------------------------

    def verified_rank(self, step: int, rank: int) -> Path:
        """Worker ``rank``'s folder of ``step``, once every byte of it has been verified.

        Raises:
            ValueError: for a bad step or rank, or a rank outside the snapshot's job.
            FileNotFoundError: if ``step`` is not complete (missing or torn).
            SnapshotCorrupted: naming the file and the problem.
        """
        check_index("step", step)
        check_index("rank", rank)
        complete = self._require_complete(step)
        if rank >= complete["world_size"]:
            raise ValueError(
                f"rank {rank} is not in the durable snapshot of step {step} "
                f"({complete['world_size']} workers)"
            )
        problems = self._verify_rank(step, rank, complete, checksums=True)
        if problems:
            raise SnapshotCorrupted(
                f"durable snapshot of step {step}, rank {rank} failed verification and was "
                f"not loaded: {'; '.join(problems)}. Roll back to an older intact snapshot "
                "(DurableStore.newest_intact)."
            )
        return checkpoint_path(self.root, step, rank)

    def load(self, step: int, rank: int, state: WorkerState) -> Progress:
        """Verify worker ``rank``'s files of ``step`` (every byte), then load them into
        ``state``'s module and optimizer. Returns the progress they hold (for the caller to
        adopt; its step is ``step``).

        Raises:
            ValueError: for a bad step or rank, or a rank outside the snapshot's job.
            FileNotFoundError: if ``step`` is not complete (missing or torn).
            SnapshotCorrupted: naming the file and the problem (verification failures
                are found before anything is loaded).
        """
        loaded = load_worker_state(self.verified_rank(step, rank), state)
        if loaded.step != step:
            raise SnapshotCorrupted(
                f"{checkpoint_path(self.root, step, rank)}: holds step {loaded.step}, not {step}"
            )
        return loaded
