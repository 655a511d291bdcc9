"""Per-worker checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout: ``<root>/step_<step>/rank_<rank>/`` holds one worker's whole state: model,
optimizer and progress. A worker writes into a temporary folder and renames it into place, so a
folder that exists is complete. This is what the ``restart`` baseline writes every
``baseline.checkpoint_every`` steps -- the checkpoint/restart practice of torchrun and Ray Train
that the recovery strategies are measured against.

The DCP primitives here (`load_worker_state`, over `recovery.state.dcp_state`: every part
of a worker's state, see [Note: one worker state]) and the atomic-file
helpers are shared with the durable snapshot tier (``recovery/snapshots/durable.py``),
which adds asynchronous writes, checksums and a commit marker on top of the same layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recovery.state import Progress, WorkerState, dcp_state, load_dcp_state

# torch.distributed.checkpoint is imported where it is used: importing it takes ~0.9 s, which
# every worker start (a cold replacement's included) would pay for nothing without
# checkpoints or durable snapshots.
#
# Every DCP call here is single-process on purpose (``no_dist=True``); DCP still warns that
# it "assumes the intent is to save in a single process" on every worker.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


def step_path(root: str | os.PathLike[str], step: int) -> Path:
    """The folder of every worker's state at ``step``."""
    return Path(root) / f"step_{step:08d}"


def checkpoint_path(root: str | os.PathLike[str], step: int, rank: int) -> Path:
    """The folder of worker ``rank``'s state at ``step``."""
    return step_path(root, step) / f"rank_{rank:04d}"


def load_worker_state(path: str | os.PathLike[str], state: WorkerState) -> Progress:
    """Load the DCP folder ``path`` into ``state``'s module and optimizer. Returns the
    progress it holds (for the caller to adopt).

    Raises:
        FileNotFoundError: if ``path`` holds no DCP checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    if not (Path(path) / ".metadata").exists():
        raise FileNotFoundError(f"no DCP checkpoint in {path}")
    # DCP loads in place: pre-allocate every tensor, the optimizer's included.
    loaded = dcp_state(state)
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    return load_dcp_state(state, loaded)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in the folder ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike[str], obj: Mapping[str, Any]) -> bytes:
    """Write ``obj`` as JSON to ``path`` atomically: a temporary file, fsync, rename.

    Returns the bytes written. A reader sees the old file or the new one, never a part.

    Raises:
        OSError: if it cannot be written (a full disk, an I/O error, a stale NFS handle);
            then the temporary file is removed and ``path`` is as it was.
    """
    path = Path(path)
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return data


def save_checkpoint(root: str | os.PathLike[str], rank: int, state: WorkerState) -> Path:
    """Write worker ``rank``'s whole state (synchronously), under its step. Returns its folder."""
    import torch.distributed.checkpoint as dcp

    final = checkpoint_path(root, state.step, rank)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    dcp.save(dcp_state(state), checkpoint_id=tmp, no_dist=True)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_checkpoint(
    root: str | os.PathLike[str], rank: int, step: int, state: WorkerState
) -> Progress:
    """Load worker ``rank``'s checkpoint of ``step`` into ``state``. Returns its progress.

    Raises:
        FileNotFoundError: if that checkpoint does not exist.
    """
    path = checkpoint_path(root, step, rank)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint of rank {rank} at step {step} in {root}")
    return load_worker_state(path, state)
