"""The durable tier's folder: which snapshot steps are complete, which are intact, and
what job wrote them; committing a step, and cleaning up.

`SnapshotFolder` is the controller's side of the durable tier (the layout is in
``recovery/snapshots/durable.py``'s module docstring): it never writes tensors. A step is
complete once ``COMPLETE.json`` is in place, with each rank's manifest digest and the
job's ``meta``; it is intact if every file still has the size and checksum its manifest
recorded. `DurableStore` adds the workers' side (writing and loading).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from parallelism.checks import check_index, check_positive_int
from recovery.errors import SnapshotCorrupted
from recovery.snapshots.checkpoint import checkpoint_path, fsync_dir, step_path, write_json_atomic

__all__ = ["COMPLETE", "FORMAT", "HASH", "MANIFEST", "SnapshotFolder", "file_digest"]

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE.json"
FORMAT = 2
"""Version of the manifest and COMPLETE.json layout, and of what a rank's files hold (2:
the whole worker state of recovery/state.py, its progress included; 1 had the step only)."""
HASH = "sha256"
"""Checksum of every file (hardware-accelerated on current CPUs: ~1.3 GB/s per core)."""
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


class SnapshotFolder:
    """The durable snapshots under ``root``, as the controller sees them (see the module
    docstring): complete steps, verification, the job's meta, commit and clean-up.

    Args:
        root: the folder (a shared filesystem when workers run on several machines).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

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
        with contextlib.suppress(IsADirectoryError):  # a directory in its way: no commit
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
