"""The durable snapshot tier: each rank's state written asynchronously with DCP, checksummed.

Every ``durable_every`` steps each worker writes its state with
torch.distributed.checkpoint (DCP) to a folder -- a shared filesystem on a real cluster --
asynchronously (`DurableStore.write`), with a checksummed manifest; the controller then
marks the step complete (`DurableStore.commit`). It survives anything, driver death
included: a re-run with the same run folder resumes from `DurableStore.newest_intact`.
Corrupted or missing files are found by checksum and never loaded (`SnapshotCorrupted`).
Which steps may be combined is [Note: snapshot consistency] (``recovery/snapshots/__init__.py``).

Durable layout (``rank_<r>`` as in ``recovery/checkpoint.py``)::

    <root>/step_00000200/rank_0000.tmp/   a write in progress (never read)
    <root>/step_00000200/rank_0000/       .metadata, __0_0.distcp (DCP) + MANIFEST.json
    <root>/step_00000200/COMPLETE.json    world size, each rank's manifest digest, meta
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

from parallelism.checks import check_index, check_positive_int
from recovery.checkpoint import (
    checkpoint_path,
    fsync_dir,
    load_worker_state,
    step_path,
    worker_state_dict,
    write_json_atomic,
)
from recovery.errors import SnapshotCorrupted

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

MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE.json"
FORMAT = 1
"""Version of the manifest and COMPLETE.json layout."""
HASH = "sha256"
"""Checksum of every file (hardware-accelerated on current CPUs: ~1.3 GB/s per core)."""
DEFAULT_TIMEOUT = timedelta(minutes=10)
_CHUNK = 4 << 20
_STEP_DIR = re.compile(r"step_(\d+)")


def file_digest(path: str | os.PathLike[str]) -> str:
    """The `HASH` hex digest of a file's bytes, read in chunks."""
    digest = hashlib.new(HASH)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _json_digest(body: Mapping[str, Any]) -> str:
    return hashlib.new(HASH, json.dumps(body, sort_keys=True).encode()).hexdigest()


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


class DurableStore:
    """Durable snapshots under ``root``, written asynchronously with DCP.

    One instance per process: each worker writes its own rank's state with `write`, and
    the controller marks steps complete with `commit`, chooses one with `newest_intact`
    and cleans up with `prune` / `discard_after`. See [Note: snapshot consistency].

    Args:
        root: the folder (a shared filesystem when workers run on several machines).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
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
        step: int,
        rank: int,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        info: Mapping[str, Any] | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> WriteHandle:
        """Start writing worker ``rank``'s state at ``step``; return once it is staged.

        The caller is held only while DCP copies every tensor to fresh CPU memory (on a
        CPU worker that is a memory copy of the whole state); writing the files, fsync,
        checksumming and renaming ``rank_<r>.tmp`` to ``rank_<r>`` happen in background
        threads, while training goes on. At most one write per rank is in flight: a new
        one first waits for the previous one (whose outcome its own handle reports).

        Args:
            info: JSON-able facts recorded in the rank's manifest (stage, replica, ...).
            timeout: how long to wait for this rank's previous write.

        Raises:
            ValueError: for a negative step or rank, or ``info`` that is not JSON-able.
            FileExistsError: if ``step`` is already complete (after a rollback, call
                `discard_after` before snapshots of later steps are taken again).
            TimeoutError: if the previous write is not done within ``timeout``.
            RuntimeError: if the store was closed.
        """
        if self._closed:
            raise RuntimeError(f"durable store {self.root} is closed")
        check_index("step", step)
        check_index("rank", rank)
        extra = dict(info or {})
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
        if (step_path(self.root, step) / COMPLETE).exists():
            raise FileExistsError(
                f"durable snapshot of step {step} in {self.root} is already complete; after a "
                "rollback, discard_after(rollback step) must drop the abandoned timeline"
            )
        started = time.perf_counter()
        final = checkpoint_path(self.root, step, rank)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            response = dcp.async_save(
                worker_state_dict(module, optimizer, step),
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

    # -- committing and choosing (controller) ---------------------------------------------

    def commit(self, step: int, world_size: int, meta: Mapping[str, Any] | None = None) -> Path:
        """Mark ``step`` complete: every rank reported its write in place.

        Writes ``COMPLETE.json`` atomically, with each rank's manifest digest (so a
        manifest cannot be swapped afterwards unnoticed) and ``meta``: what a re-run
        needs to recognise its own job (topology, spec name, data fingerprint...), read
        back by `load_meta` / `check_meta`. Returns the file's path.

        Raises:
            ValueError: for a bad step or world size, or ``meta`` that is not JSON-able.
            FileNotFoundError: if some rank's folder or manifest is not in place.
            SnapshotCorrupted: if some rank's manifest is unreadable or for another step.
        """
        check_index("step", step)
        check_positive_int("world_size", world_size)
        body_meta = dict(meta or {})
        try:
            json.dumps(body_meta)
        except TypeError as exc:
            raise ValueError(f"snapshot meta must be JSON-able: {exc}") from None
        missing = [
            rank
            for rank in range(world_size)
            if not (checkpoint_path(self.root, step, rank) / MANIFEST).is_file()
        ]
        if missing:
            raise FileNotFoundError(
                f"cannot commit the durable snapshot of step {step}: ranks {missing} have no "
                f"finished write in {step_path(self.root, step)}"
            )
        ranks: dict[str, str] = {}
        for rank in range(world_size):
            path = checkpoint_path(self.root, step, rank) / MANIFEST
            raw = path.read_bytes()
            try:
                manifest = json.loads(raw)
                ok = manifest["step"] == step and manifest["rank"] == rank
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                raise SnapshotCorrupted(f"{path}: unreadable, or not rank {rank}'s of step {step}")
            ranks[str(rank)] = hashlib.new(HASH, raw).hexdigest()
        body = {
            "format": FORMAT,
            "step": step,
            "world_size": world_size,
            "hash": HASH,
            "ranks": ranks,
            "meta": body_meta,
            "committed_at": time.time(),
        }
        body["digest"] = _json_digest(body)
        path = step_path(self.root, step) / COMPLETE
        write_json_atomic(path, body)
        return path

    def steps(self) -> list[int]:
        """Complete steps (with a COMPLETE.json, not yet verified), newest first."""
        return sorted((s for s, complete in self._step_dirs() if complete), reverse=True)

    def verify(self, step: int, world_size: int, *, checksums: bool = True) -> list[str]:
        """Problems that make snapshot ``step`` unusable; an empty list means intact.

        Checks COMPLETE.json, then for every rank: its folder, its manifest (against the
        digest COMPLETE.json recorded) and every file's size and, with ``checksums``, its
        bytes (which reads the whole snapshot). Each problem names the file.

        Raises:
            ValueError: for a bad step or world size.
        """
        check_index("step", step)
        check_positive_int("world_size", world_size)
        complete, problem = self._read_complete(step)
        if complete is None:
            return [problem]
        if complete["world_size"] != world_size:
            return [
                f"{step_path(self.root, step) / COMPLETE}: written by a job of "
                f"{complete['world_size']} workers, this job has {world_size}"
            ]
        problems: list[str] = []
        for rank in range(world_size):
            problems += self._verify_rank(step, rank, complete, checksums=checksums)
        return problems

    def newest_intact(self, world_size: int, *, checksums: bool = True) -> int | None:
        """The newest complete step that verifies, or None; logs why newer ones were skipped.

        With ``checksums=False`` only sizes are checked (cheap: no data is read); `load`
        still checks every byte it loads, so a caller that chose a step this way must
        fall back to an older one when a rank's `load` raises `SnapshotCorrupted`.

        Raises:
            ValueError: for a bad world size.
        """
        for step in self.steps():
            problems = self.verify(step, world_size, checksums=checksums)
            if not problems:
                return step
            log.warning(
                "durable snapshot of step %d in %s is not intact, skipping it: %s",
                step,
                self.root,
                "; ".join(problems),
            )
        return None

    def require_intact(self, world_size: int, *, checksums: bool = True) -> int:
        """Like `newest_intact`, but an error that lists every rejected snapshot.

        Raises:
            FileNotFoundError: if there is no complete snapshot at all.
            SnapshotCorrupted: if every complete snapshot fails verification.
        """
        steps = self.steps()
        if not steps:
            raise FileNotFoundError(f"no complete durable snapshot in {self.root}")
        found = self.newest_intact(world_size, checksums=checksums)
        if found is not None:
            return found
        reasons = [
            f"step {s}: {'; '.join(self.verify(s, world_size, checksums=checksums))}" for s in steps
        ]
        raise SnapshotCorrupted(
            f"no intact durable snapshot in {self.root} for {world_size} workers:\n  "
            + "\n  ".join(reasons)
        )

    def load_meta(self, step: int) -> dict[str, Any]:
        """The ``meta`` the controller passed to `commit` for ``step``.

        Raises:
            FileNotFoundError: if ``step`` is not complete.
            SnapshotCorrupted: if its COMPLETE.json is unreadable or altered.
        """
        complete = self._require_complete(step)
        return dict(complete["meta"])

    def check_meta(self, step: int, expected: Mapping[str, Any]) -> None:
        """Refuse a snapshot another job wrote: every key of ``expected`` must match.

        Raises:
            FileNotFoundError: if ``step`` is not complete.
            SnapshotCorrupted: if its COMPLETE.json is unreadable or altered.
            ValueError: naming every key whose value differs.
        """
        meta = self.load_meta(step)
        # Compare as JSON would store them (tuples become lists).
        wanted = json.loads(json.dumps(dict(expected)))
        diffs = [
            f"{key}: {value!r} here, {meta.get(key, '<absent>')!r} in the snapshot"
            for key, value in wanted.items()
            if meta.get(key, object()) != value
        ]
        if diffs:
            raise ValueError(
                f"the durable snapshot of step {step} in {self.root} was written by a "
                f"different job ({'; '.join(diffs)}); use a new run folder or the original "
                "settings"
            )

    # -- loading (workers) ----------------------------------------------------------------

    def load(
        self, step: int, rank: int, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> int:
        """Verify worker ``rank``'s files of ``step`` (every byte), then load them into
        ``module`` and ``optimizer``. Returns the step (= the data cursor).

        Raises:
            ValueError: for a bad step or rank, or a rank outside the snapshot's job.
            FileNotFoundError: if ``step`` is not complete (missing or torn).
            SnapshotCorrupted: naming the file and the problem (verification failures
                are found before anything is loaded).
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
        loaded = load_worker_state(checkpoint_path(self.root, step, rank), module, optimizer)
        if loaded != step:
            raise SnapshotCorrupted(
                f"{checkpoint_path(self.root, step, rank)}: holds step {loaded}, not {step}"
            )
        return loaded

    # -- cleaning up (controller) ---------------------------------------------------------

    def prune(self, keep: int, *, checksums: bool = True) -> list[int]:
        """Delete all but the newest ``keep`` complete snapshots. Returns the steps deleted.

        Never deletes the newest intact snapshot, even when the ``keep`` newest all fail
        verification (finding it reads the newest snapshots; ``checksums=False`` checks
        sizes only). Torn folders older than the newest complete step are abandoned
        writes and are deleted too; newer ones may be in flight and are left alone.
        Deletion removes COMPLETE.json first, so a crash half-way leaves a torn folder.

        Raises:
            ValueError: if ``keep`` is not a positive integer.
        """
        check_positive_int("keep", keep)
        complete = self.steps()
        protected = set(complete[:keep])
        for step in complete:
            body, _ = self._read_complete(step)
            if body is not None and not self.verify(step, body["world_size"], checksums=checksums):
                protected.add(step)
                break
        newest = complete[0] if complete else None
        removed = []
        for step, is_complete in sorted(self._step_dirs()):
            if step in protected:
                continue
            if is_complete or (newest is not None and step < newest):
                self._remove(step)
                removed.append(step)
        return removed

    def discard_after(self, step: int) -> list[int]:
        """Delete every snapshot (complete or torn) newer than ``step``. Returns them.

        Call it after a rollback or a resume to ``step``, before new snapshots are taken
        (see [Note: snapshot consistency]), and never while a write is in flight.

        Raises:
            ValueError: for a negative step.
        """
        check_index("step", step)
        removed = [s for s, _ in sorted(self._step_dirs()) if s > step]
        for s in removed:
            self._remove(s)
        return removed

    # -- helpers ---------------------------------------------------------------------------

    def _step_dirs(self) -> Iterable[tuple[int, bool]]:
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.fullmatch(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), (path / COMPLETE).is_file()))
        return found

    def _remove(self, step: int) -> None:
        folder = step_path(self.root, step)
        (folder / COMPLETE).unlink(missing_ok=True)
        fsync_dir(folder)
        shutil.rmtree(folder, ignore_errors=True)

    def _read_complete(self, step: int) -> tuple[dict[str, Any] | None, str]:
        path = step_path(self.root, step) / COMPLETE
        if not path.is_file():
            return None, f"{path}: missing (step {step} is not complete)"
        try:
            body = json.loads(path.read_bytes())
            digest = body.pop("digest")
            if digest != _json_digest(body):
                return None, f"{path}: altered (its digest does not match its contents)"
            if body["step"] != step or not isinstance(body["world_size"], int):
                return None, f"{path}: describes step {body['step']}, not {step}"
            if body["format"] != FORMAT or body["hash"] != HASH:
                return None, f"{path}: format {body['format']}/{body['hash']} is not supported"
            return body, ""
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return None, f"{path}: unreadable ({type(exc).__name__}: {exc})"

    def _require_complete(self, step: int) -> dict[str, Any]:
        complete, problem = self._read_complete(step)
        if complete is not None:
            return complete
        if not (step_path(self.root, step) / COMPLETE).is_file():
            raise FileNotFoundError(
                f"no complete durable snapshot of step {step} in {self.root} "
                f"(complete: {self.steps() or 'none'})"
            )
        raise SnapshotCorrupted(problem)

    def _verify_rank(
        self, step: int, rank: int, complete: Mapping[str, Any], *, checksums: bool
    ) -> list[str]:
        folder = checkpoint_path(self.root, step, rank)
        if not folder.is_dir():
            return [f"{folder}: missing"]
        path = folder / MANIFEST
        if not path.is_file():
            return [f"{path}: missing"]
        raw = path.read_bytes()
        if hashlib.new(HASH, raw).hexdigest() != complete["ranks"].get(str(rank)):
            return [f"{path}: does not match the manifest committed in {COMPLETE}"]
        try:
            manifest = json.loads(raw)
            files: dict[str, dict[str, Any]] = manifest["files"]
            if manifest["step"] != step or manifest["rank"] != rank:
                return [f"{path}: describes step {manifest['step']}, rank {manifest['rank']}"]
        except (ValueError, KeyError, TypeError) as exc:
            return [f"{path}: unreadable ({type(exc).__name__}: {exc})"]
        problems = []
        for name, entry in sorted(files.items()):
            file = folder / name
            if Path(name).name != name or name == MANIFEST:
                problems.append(f"{path}: bad file name {name!r}")
            elif not file.is_file():
                problems.append(f"{file}: missing")
            elif (size := file.stat().st_size) != entry["size"]:
                problems.append(f"{file}: {size} bytes, the manifest says {entry['size']}")
            elif checksums and (digest := file_digest(file)) != entry[HASH]:
                problems.append(
                    f"{file}: {HASH} {digest[:12]}... does not match the manifest's "
                    f"{entry[HASH][:12]}..."
                )
        return problems
