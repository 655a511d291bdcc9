"""Snapshots for the ``rollback`` strategy, in two tiers: peer memory and durable files.

*Peer memory*: every ``snapshot_every`` steps each worker packs its state into one
contiguous byte tensor (`pack_state`), keeps that copy itself and sends it to its buddy
(`buddy_of`), which holds it in `PeerSnapshots`. A rollback to step S needs every rank's
state at S somewhere alive (`peer_rollback_step`): survivors use their own copies, dead
workers' replacements get theirs back from the buddy. It survives any failure that does
not take a worker and its buddy together.

*Durable*: every ``durable_every`` steps each worker writes its state with
torch.distributed.checkpoint (DCP) to a folder -- a shared filesystem on a real cluster --
asynchronously (`DurableStore.write`), with a checksummed manifest; the controller then
marks the step complete (`DurableStore.commit`). It survives anything, driver death
included: a re-run with the same run folder resumes from `DurableStore.newest_intact`.
Corrupted or missing files are found by checksum and never loaded (`SnapshotCorrupted`).

Durable layout (``rank_<r>`` as in ``recovery/checkpoint.py``)::

    <root>/step_00000200/rank_0000.tmp/   a write in progress (never read)
    <root>/step_00000200/rank_0000/       .metadata, __0_0.distcp (DCP) + MANIFEST.json
    <root>/step_00000200/COMPLETE.json    world size, each rank's manifest digest, meta

[Note: snapshot consistency]
A snapshot of step S is, for every rank, the state it holds after committing steps
0..S-1 and before running step S: its step counter (= data cursor) is S, and its RNG
needs no bytes because every draw derives from ``(seed, stage, replica, step)``
(``parallelism/seeding.py``). Under the two-phase step (see ``recovery/worker.py``) no
worker applies step S until every worker is ready, so "the state at S" is one well-defined
set of world-size states, and each worker's part is labelled with S when it is taken.
Both `pack_state` and DCP's async staging copy the tensors before returning, so the
optimizer update that follows cannot leak into a snapshot. Parts are only ever combined
by label: a durable step is COMPLETE only when the controller has seen every rank's write
finish and every rank folder and manifest is in place (`DurableStore.commit`; a folder
without COMPLETE.json is torn and never loaded), and a peer rollback picks a step S for
which every rank's S-labelled part survives (`peer_rollback_step`). One caveat makes
labels unambiguous: after a rollback to S, the states of steps after S belong to an
abandoned timeline (the replay need not reproduce them bit for bit: an approximate
recovery may come in between), so every snapshot newer than S must be dropped before
new ones are taken
(`PeerSnapshots.discard_after`, `DurableStore.discard_after`); otherwise a later rollback
could mix parts of two timelines under one label.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
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

from parallelism.topology import Topology
from recovery.checkpoint import (
    checkpoint_path,
    fsync_dir,
    load_worker_state,
    step_path,
    worker_state_dict,
    write_json_atomic,
)
from recovery.errors import SnapshotCorrupted

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


def _check_index(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _check_positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------
# Durable tier
# ---------------------------------------------------------------------------------------


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
        _check_index(step, "step")
        _check_index(rank, "rank")
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
        _check_index(step, "step")
        _check_positive(world_size, "world_size")
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
        _check_index(step, "step")
        _check_positive(world_size, "world_size")
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
        _check_index(step, "step")
        _check_index(rank, "rank")
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
        _check_positive(keep, "keep")
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
        _check_index(step, "step")
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


# ---------------------------------------------------------------------------------------
# Peer-memory tier
# ---------------------------------------------------------------------------------------

_RESTARTS = 8  # random restarts of the buddy ring search, for jobs of up to
_RESTARTS_UP_TO = 64  # this many workers (where they are cheap)
_ALIGN = 64  # every tensor starts at a multiple of this, so any dtype can view its bytes


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives inside a `PackedState`'s bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Ref:
    """Stands for tensor ``index`` of the layout inside the optimizer's description."""

    index: int


@dataclass(frozen=True, eq=False)
class PackedState:
    """A worker's state (module, optimizer, step) as one contiguous byte tensor.

    ``data`` is what travels (a single send/recv); `header` is the small picklable rest.
    """

    step: int
    data: torch.Tensor
    """uint8, 1-D, contiguous: every tensor's bytes, each at a 64-byte-aligned offset."""
    layout: tuple[TensorSlot, ...]
    """The model's state_dict tensors (in order), then the optimizer's."""
    model_tensors: int
    """How many leading entries of ``layout`` belong to the module."""
    optimizer: dict[str, Any]
    """``optimizer.state_dict()`` with every tensor replaced by a reference into ``layout``."""

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def header(self) -> bytes:
        """Everything but ``data``, pickled: send it first, then ``data``."""
        return pickle.dumps((self.step, self.layout, self.model_tensors, self.optimizer))

    @classmethod
    def from_parts(cls, header: bytes, data: torch.Tensor) -> PackedState:
        """Rebuild a packed state from a received `header` and ``data``.

        Raises:
            ValueError: if ``data`` is not a 1-D uint8 tensor of the size the header needs.
        """
        step, layout, model_tensors, optimizer = pickle.loads(header)
        need = max((s.offset + s.nbytes for s in layout), default=0)
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < need:
            raise ValueError(
                f"packed state data must be 1-D uint8 of at least {need} bytes, got "
                f"{data.dtype} {tuple(data.shape)}"
            )
        return cls(step, data, layout, model_tensors, optimizer)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flatten(obj: Any, found: list[tuple[str, torch.Tensor]], where: str) -> Any:
    """``obj`` with every tensor replaced by a `_Ref`; the tensors appended to ``found``."""
    if isinstance(obj, torch.Tensor):
        found.append((where, obj))
        return _Ref(len(found) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, found, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_flatten(v, found, f"{where}.{i}") for i, v in enumerate(obj))
    return obj


def _unflatten(obj: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensor(obj.index)
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensor) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_unflatten(v, tensor) for v in obj)
    return obj


def _view(data: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    raw = data[slot.offset : slot.offset + slot.nbytes]
    return raw.view(getattr(torch, slot.dtype)).view(slot.shape)


def pack_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    *,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> PackedState:
    """Copy a worker's state into one contiguous byte tensor on ``device`` (host memory by
    default: that is where a buddy keeps it). The copy is taken now; later updates to
    the module or optimizer do not change it.

    Args:
        out: a byte tensor to pack into (the data of a snapshot no longer needed) instead
            of allocating: copying into memory already touched is ~3x faster on CPU than
            into fresh pages. Used when it is a 1-D uint8 tensor on ``device`` that is
            large enough, ignored otherwise. Nothing else may still read it.

    Raises:
        ValueError: for a negative step.
    """
    _check_index(step, "step")
    tensors: list[tuple[str, torch.Tensor]] = list(module.state_dict().items())
    model_tensors = len(tensors)
    optimizer_desc = _flatten(optimizer.state_dict(), tensors, "optimizer")
    layout = []
    offset = 0
    for name, t in tensors:
        offset = -(-offset // _ALIGN) * _ALIGN
        nbytes = t.numel() * t.element_size()
        layout.append(TensorSlot(name, tuple(t.shape), _dtype_name(t.dtype), offset, nbytes))
        offset += nbytes
    usable = (
        out is not None
        and out.dtype == torch.uint8
        and out.dim() == 1
        and out.device == torch.device(device)
        and out.numel() >= offset
    )
    data = (
        out[:offset]
        if out is not None and usable
        else torch.empty(offset, dtype=torch.uint8, device=device)
    )
    with torch.no_grad():
        for slot, (_, t) in zip(layout, tensors, strict=True):
            if slot.nbytes:
                flat = t.detach().reshape(-1).view(torch.uint8)
                data[slot.offset : slot.offset + slot.nbytes].copy_(flat)
    return PackedState(step, data, tuple(layout), model_tensors, optimizer_desc)


def unpack_state(packed: PackedState, module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Replace ``module``'s and ``optimizer``'s state with ``packed``'s, bit for bit.
    Returns its step. The result shares no memory with ``packed``.

    Raises:
        ValueError: if ``packed`` is another stage's or model's state (different names,
            shapes, dtypes or parameter groups), before anything is changed.
    """
    model = module.state_dict()
    expected = [(k, tuple(v.shape), _dtype_name(v.dtype)) for k, v in model.items()]
    got = [(s.name, s.shape, s.dtype) for s in packed.layout[: packed.model_tensors]]
    if expected != got:
        diff = next(
            (f"{e} vs {g}" for e, g in zip(expected, got, strict=False) if e != g),
            f"{len(expected)} tensors vs {len(got)}",
        )
        raise ValueError(f"packed state does not match this module: first difference {diff}")
    groups = [len(g["params"]) for g in optimizer.param_groups]
    packed_groups = [len(g["params"]) for g in packed.optimizer["param_groups"]]
    if groups != packed_groups:
        raise ValueError(
            f"packed optimizer state has parameter groups of sizes {packed_groups}, this "
            f"optimizer {groups}"
        )
    with torch.no_grad():
        for slot, key in zip(packed.layout, model, strict=False):
            model[key].copy_(_view(packed.data, slot))
    # Optimizer.load_state_dict keeps tensors that already have the right dtype and
    # device, so each one is cloned: the snapshot must stay unchanged by later steps.
    state = _unflatten(packed.optimizer, lambda i: _view(packed.data, packed.layout[i]).clone())
    optimizer.load_state_dict(state)
    return packed.step


def _same_node_critical(topology: Topology, node_of: Mapping[int, str]) -> set[str]:
    """Nodes that host every replica of some stage: losing one forces a rollback."""
    critical = set()
    for stage in range(topology.stages):
        nodes = {node_of[r] for r in topology.stage_group(stage)}
        if len(nodes) == 1:
            critical |= nodes
    return critical


class _RingCost:
    """Cost of a ring (see `buddy_ring`): the sum over consecutive pairs of
    ``(n + 1) * (same stage or same critical node) + same node``, so that any ring with
    fewer pairs of the first kind costs less."""

    def __init__(self, topology: Topology, node_of: Mapping[int, str]) -> None:
        n = topology.world_size
        critical = _same_node_critical(topology, node_of)
        self.stage = [topology.worker(r).stage for r in range(n)]
        self.node = [node_of[r] for r in range(n)]
        self.weight = n + 1
        self.critical = [self.node[r] in critical for r in range(n)]

    def pair(self, a: int, b: int) -> int:
        same_node = self.node[a] == self.node[b]
        severe = self.stage[a] == self.stage[b] or (same_node and self.critical[a])
        return severe * self.weight + same_node

    def total(self, ring: list[int]) -> int:
        return sum(self.pair(ring[i - 1], ring[i]) for i in range(len(ring)))

    def lower_bound(self) -> int:
        """No ring costs less: a group of ``m`` of the ``n`` ranks (a stage, a node) has at
        least ``2m - n`` of its members followed by a member."""
        n = len(self.stage)

        def excess(labels: Iterable[object]) -> int:
            counts: dict[object, int] = {}
            for label in labels:
                counts[label] = counts.get(label, 0) + 1
            return max(0, 2 * max(counts.values(), default=0) - n)

        critical = excess(node for node, c in zip(self.node, self.critical, strict=True) if c)
        return max(excess(self.stage), critical) * self.weight + excess(self.node)

    def greedy(self, first: int) -> list[int]:
        """Nearest-neighbour ring from ``first``: each next rank is a cheapest one, ties
        going to the node (then the stage) with the most ranks left, so that no node's
        ranks are left to the end to sit side by side."""
        n = len(self.stage)
        left = set(range(n)) - {first}
        per_node: dict[str, int] = {}
        per_stage: dict[int, int] = {}
        for r in left:
            per_node[self.node[r]] = per_node.get(self.node[r], 0) + 1
            per_stage[self.stage[r]] = per_stage.get(self.stage[r], 0) + 1
        ring = [first]
        while left:
            last = ring[-1]
            nxt = min(
                left,
                key=lambda r: (
                    self.pair(last, r),
                    -per_node[self.node[r]],
                    -per_stage[self.stage[r]],
                    r,
                ),
            )
            left.remove(nxt)
            per_node[self.node[nxt]] -= 1
            per_stage[self.stage[nxt]] -= 1
            ring.append(nxt)
        return ring

    def improve(self, ring: list[int]) -> list[int]:
        """Local search from ``ring``: while some move lowers the cost, apply it. Moves
        start at a costly pair: reverse a segment (2-opt) or swap one of its ranks. Each
        move lowers the (integer) cost, so the search ends."""
        n = len(ring)
        improved = True
        while improved:
            improved = False
            for e in range(n):
                if self.pair(ring[e], ring[(e + 1) % n]) and self._move(ring, e):
                    improved = True
        return ring

    def _move(self, ring: list[int], e: int) -> bool:
        """Apply one cost-lowering move at the costly pair ``(ring[e], ring[e+1])``."""
        n = len(ring)
        pair = self.pair
        a, b = ring[e], ring[(e + 1) % n]
        for f in range(n):  # 2-opt: reverse ring[e+1 .. f]
            c, d = ring[f], ring[(f + 1) % n]
            if f == e or pair(a, c) + pair(b, d) >= pair(a, b) + pair(c, d):
                continue
            i, j = (e + 1) % n, f
            if i <= j:
                ring[i : j + 1] = ring[i : j + 1][::-1]
            else:  # the segment wraps: reverse it in place through the seam
                seg = [ring[k % n] for k in range(i, j + n + 1)][::-1]
                for k, r in zip(range(i, j + n + 1), seg, strict=True):
                    ring[k % n] = r
            return True
        for i in (e, (e + 1) % n):  # swap an end of the costly pair with any rank
            for j in range(n):
                if j == i:
                    continue
                before = self._around(ring, (i, j))
                ring[i], ring[j] = ring[j], ring[i]
                if self._around(ring, (i, j)) < before:
                    return True
                ring[i], ring[j] = ring[j], ring[i]
        return False

    def _around(self, ring: list[int], positions: tuple[int, int]) -> int:
        """Cost of the pairs that touch ``positions``."""
        n = len(ring)
        edges = {(p - 1) % n for p in positions} | {p % n for p in positions}
        return sum(self.pair(ring[e], ring[(e + 1) % n]) for e in edges)


def buddy_ring(topology: Topology, node_of: Mapping[int, str]) -> tuple[int, ...]:
    """The ring of peer snapshots: rank ``ring[i]``'s state is held by ``ring[i + 1]``.

    The rule follows from what the peer tier must survive. A rollback is only needed
    when some stage has lost every replica (otherwise ``replica_copy`` rebuilds the lost
    workers exactly and no snapshot is read), so above all a buddy must not share with
    its ward (1) a stage -- the stage group's loss would take both -- or (2) a node that
    hosts every replica of some stage -- that node's loss forces a rollback and takes
    both. Among the rings with the fewest such pairs, it takes one with (3) the fewest
    same-node pairs, for failures that combine a node with more. So:

    - one node: the buddy is the next rank (a different stage whenever there are 2+);
    - ``place()``'s layout on 2+ nodes: buddies on other nodes and of other stages,
      except where node sizes make that impossible (one node holds more than half of
      the workers: the fewest same-node pairs possible), and with 2 stages on 2 nodes,
      where nodes and stages cannot both alternate and the ring keeps stages apart;
    - a stage on a single node (e.g. one replica): that node is avoided like a stage.

    The search is deterministic, the same in every process: three candidate orders
    (rank order, nodes interleaved, greedy) improved by 2-opt and swap moves, plus a few
    seeded restarts for jobs of up to 64 workers. It matched brute force on every job of
    up to 8 workers tried (tests/test_snapshots.py checks up to 6) and takes ~1 s for 256.

    Raises:
        ValueError: if ``node_of`` lacks some rank.
    """
    n = topology.world_size
    missing = [r for r in range(n) if r not in node_of]
    if missing:
        raise ValueError(f"node_of has no node for ranks {missing}")
    natural = list(range(n))
    if len({node_of[r] for r in natural}) == 1:
        return tuple(natural)
    cost = _RingCost(topology, node_of)
    groups: dict[str, list[int]] = {}
    for r in natural:
        groups.setdefault(node_of[r], []).append(r)
    by_size = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    ordered = [r for g in by_size for r in g]
    # Fill even positions, then odd ones: no two neighbours share a node unless one node
    # holds more than half of the ranks.
    interleaved = [0] * n
    positions = list(range(0, n, 2)) + list(range(1, n, 2))
    for pos, r in zip(positions, ordered, strict=True):
        interleaved[pos] = r
    candidates = (natural, interleaved, cost.greedy(0))
    best = min((cost.improve(c) for c in candidates), key=cost.total)
    shuffler = random.Random(0)  # fixed seed: every process computes the same ring
    bound = cost.lower_bound()
    for _ in range(_RESTARTS if n <= _RESTARTS_UP_TO else 0):
        if cost.total(best) <= bound:
            break
        candidate = cost.improve(shuffler.sample(natural, n))
        if cost.total(candidate) < cost.total(best):
            best = candidate
    return tuple(best)


def buddies(topology: Topology, node_of: Mapping[int, str]) -> dict[int, int]:
    """Every rank's buddy (the rank that holds its peer snapshot). See `buddy_ring`.

    Raises:
        ValueError: if ``node_of`` lacks some rank.
    """
    ring = buddy_ring(topology, node_of)
    return {ring[i]: ring[(i + 1) % len(ring)] for i in range(len(ring))}


def buddy_of(rank: int, topology: Topology, node_of: Mapping[int, str]) -> int:
    """The rank that holds ``rank``'s peer snapshot: the next one on `buddy_ring`.

    In a one-worker job that is the worker itself (nothing survives its loss).

    Raises:
        ValueError: if ``rank`` is outside the job or ``node_of`` lacks some rank.
    """
    topology.worker(rank)  # validates
    return buddies(topology, node_of)[rank]


class PeerSnapshots:
    """The packed states one worker holds: its own and its ward's, for a few steps.

    Keeps at most ``keep`` steps (default 2: the newest consistent snapshot survives
    while the next one is being taken); putting a newer step evicts the oldest. Once the
    controller knows a step is held everywhere, `drop_before` frees the older ones.
    Thread-safe: the exchange may run beside training.

    Raises:
        ValueError: if ``keep`` is not a positive integer.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = _check_positive(keep, "keep")
        self._held: dict[int, dict[int, PackedState]] = {}
        self._lock = threading.Lock()

    def put(self, step: int, rank: int, packed: PackedState) -> list[int]:
        """Hold rank ``rank``'s state at ``step``. Returns the steps evicted to make room.

        Raises:
            ValueError: if ``packed`` is of another step, or ``step`` is older than every
                held step while ``keep`` are held (it would be evicted at once).
        """
        _check_index(step, "step")
        _check_index(rank, "rank")
        if packed.step != step:
            raise ValueError(f"packed state is of step {packed.step}, not {step}")
        with self._lock:
            evicted = []
            if step not in self._held:
                if len(self._held) >= self.keep and step < min(self._held):
                    raise ValueError(
                        f"step {step} is older than every held step {sorted(self._held)}; "
                        "after a rollback, discard_after(rollback step) first"
                    )
                while len(self._held) >= self.keep:
                    oldest = min(self._held)
                    del self._held[oldest]
                    evicted.append(oldest)
            self._held.setdefault(step, {})[rank] = packed
            return evicted

    def get(self, step: int, rank: int) -> PackedState:
        """Rank ``rank``'s state at ``step``.

        Raises:
            KeyError: if it is not held here.
        """
        with self._lock:
            try:
                return self._held[step][rank]
            except KeyError:
                raise KeyError(
                    f"no peer snapshot of rank {rank} at step {step} here "
                    f"(held: {self._describe()})"
                ) from None

    def steps(self, rank: int | None = None) -> list[int]:
        """Steps held (for ``rank`` only, if given), newest first."""
        with self._lock:
            return sorted(
                (s for s, ranks in self._held.items() if rank is None or rank in ranks),
                reverse=True,
            )

    def holdings(self) -> dict[int, frozenset[int]]:
        """For each rank held here, the steps held: what `peer_rollback_step` needs."""
        with self._lock:
            out: dict[int, set[int]] = {}
            for step, ranks in self._held.items():
                for rank in ranks:
                    out.setdefault(rank, set()).add(step)
            return {rank: frozenset(steps) for rank, steps in out.items()}

    def drop_before(self, step: int) -> list[int]:
        """Free every step older than ``step``. Returns the steps dropped."""
        with self._lock:
            dropped = sorted(s for s in self._held if s < step)
            for s in dropped:
                del self._held[s]
            return dropped

    def discard_after(self, step: int) -> list[int]:
        """Drop every step newer than ``step`` (after a rollback to it; see
        [Note: snapshot consistency]). Returns the steps dropped."""
        with self._lock:
            dropped = sorted(s for s in self._held if s > step)
            for s in dropped:
                del self._held[s]
            return dropped

    def nbytes(self) -> int:
        """Bytes of the packed states held."""
        with self._lock:
            return sum(p.nbytes for ranks in self._held.values() for p in ranks.values())

    def _describe(self) -> str:
        return (
            ", ".join(f"step {s}: ranks {sorted(r)}" for s, r in sorted(self._held.items()))
            or "nothing"
        )


def peer_rollback_step(
    alive: set[int],
    held: Mapping[int, Mapping[int, Iterable[int]]],
    own: Mapping[int, Iterable[int]],
    world_size: int,
) -> int | None:
    """The newest step S at which every rank's state survives somewhere alive, or None.

    Rank ``r``'s state at S survives if ``r`` is alive and kept its own copy
    (``S in own[r]``) or some live holder ``h`` holds it (``S in held[h][r]``). Entries of
    dead workers are ignored. Survivors roll back from their own copies; each dead rank's
    replacement receives its state from a live holder.

    Raises:
        ValueError: for a world size below 1 or a rank outside ``0..world_size-1``.
    """
    _check_positive(world_size, "world_size")
    ranks = set(range(world_size))
    mentioned = set(alive) | set(held) | set(own)
    for ward_steps in held.values():
        mentioned |= set(ward_steps)
    if not mentioned <= ranks:
        raise ValueError(f"ranks {sorted(mentioned - ranks)} outside a job of {world_size}")
    available: dict[int, set[int]] = {r: set() for r in ranks}
    for rank in alive:
        available[rank] |= set(own.get(rank, ()))
    for holder, wards in held.items():
        if holder in alive:
            for ward, steps in wards.items():
                available[ward] |= set(steps)
    common = set.intersection(*available.values())
    return max(common, default=None)
