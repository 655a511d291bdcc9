"""The on-disk cache of a parsed Criteo file, and the identity of a set of click samples.

`criteo_cache` parses a Criteo file once per machine into memory-mappable arrays (see
[Note: shipping click logs to workers]); `load_criteo` maps them once per process and
checks they are the samples a dataset was made of (`fingerprint_samples`).

[Note: shipping click logs to workers]
A Criteo day is about 45 million lines (11 GB of text); as Python lists it would need
tens of GB, and inside a pickled `TrainSpec` it would travel to every actor.
`ClickDataset.from_criteo` instead parses the file once per machine, a chunk of lines at
a time, into raw arrays in a cache folder (264 bytes a sample for Criteo) keyed by the
file's path, size, modification time, first MiB and the parse options, and memory-maps
them. The dataset pickles as a recipe (the path, the options, the cache folder) plus the
samples' fingerprint (a SHA-256 of the arrays, computed while parsing): the receiving
process maps the cache on first use, parsing the file if that machine has no cache yet,
keeps the mapping in a per-process table keyed by fingerprint, and refuses samples whose
fingerprint differs, so two machines whose files differ never silently train on
different data. The same pattern as `parallelism.workloads.data.TokenCorpus`.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parallelism.workloads.clicks.batch import ClickBatch
from parallelism.workloads.clicks.criteo import (
    CHUNK_LINES,
    CriteoFormat,
    criteo_chunks,
    criteo_path,
)

__all__ = ["array_digest", "criteo_cache", "fingerprint_samples", "load_criteo"]

_log = logging.getLogger(__name__)

_CACHE_VERSION = 1
_HEAD_BYTES = 1 << 20
_LOCK_WAIT = datetime.timedelta(hours=2)
"""The longest to wait for another process parsing the same file (a Criteo day: minutes)."""
_PROGRESS_EVERY = 1_000_000
_ARRAYS = (("labels", np.float32), ("dense", np.float32), ("sparse", np.int64))

# Samples already mapped in this process, by fingerprint.
_LOADED: dict[str, ClickBatch] = {}
_LOADED_LOCK = threading.Lock()


def _default_cache_dir() -> Path:
    if os.environ.get("CHECKFREE_CACHE_DIR"):
        return Path(os.environ["CHECKFREE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "checkfree"


def _cache_key(path: Path, fmt: CriteoFormat) -> str:
    stat = path.stat()
    with path.open("rb") as handle:
        head = hashlib.sha256(handle.read(_HEAD_BYTES)).hexdigest()
    ident = {
        "version": _CACHE_VERSION,
        "path": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "head_sha256": head,
        "format": dataclasses.asdict(fmt),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def criteo_cache(
    path: str, fmt: CriteoFormat, cache_dir: str | None, chunk_lines: int = CHUNK_LINES
) -> dict[str, Any]:
    """The cache's metadata (``samples``, ``fingerprint``, ``dir``), parsing the file if no
    cache of this file and format exists yet.

    Concurrent callers on one machine take a lock, so the file is parsed once (a caller
    waits at most `_LOCK_WAIT` for another's parse); the cache appears under its final
    name only when complete, and the partial folders of writers that died are removed.

    Raises:
        ValueError: for a bad file or line (see `read_criteo`), an unwritable cache folder,
            or a lock held past `_LOCK_WAIT`.
    """
    p = criteo_path(path)
    root = (Path(cache_dir) if cache_dir is not None else _default_cache_dir()) / "criteo"
    key = _cache_key(p, fmt)
    final = root / key
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = (root / f"{key}.lock").open("a")
    except OSError as err:
        raise ValueError(
            f"cannot write the Criteo cache folder {root} ({err}); pass another cache_dir or "
            "set CHECKFREE_CACHE_DIR"
        ) from None
    with lock:
        _lock(lock, f"{root / key}.lock", p)
        meta = _read_meta(final, fmt)
        if meta is None:
            shutil.rmtree(final, ignore_errors=True)
            for stale in root.glob(f"{key}.partial-*"):  # its writer died holding the lock
                shutil.rmtree(stale, ignore_errors=True)
            _write_cache(p, fmt, root, final, chunk_lines)
            meta = _read_meta(final, fmt)
            assert meta is not None, f"the Criteo cache {final} was just written"
    return meta


def _lock(handle: Any, name: str, path: Path) -> None:
    """Take the cache's lock, waiting at most `_LOCK_WAIT` for another parse of the file."""
    deadline = time.monotonic() + _LOCK_WAIT.total_seconds()
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"another process has held {name} for over {_LOCK_WAIT} while parsing "
                    f"{path}; if it is stuck, end it (the lock is released when it exits)"
                ) from None
            time.sleep(0.2)


def _read_meta(folder: Path, fmt: CriteoFormat) -> dict[str, Any] | None:
    """A complete cache's metadata, or None if there is none (or it is damaged)."""
    try:
        meta: dict[str, Any] = json.loads((folder / "meta.json").read_text())
        n = meta["samples"]
        widths = {"labels": 1, "dense": fmt.dense_features, "sparse": len(fmt.table_rows)}
        for name, dtype in _ARRAYS:
            if (folder / name).stat().st_size != n * widths[name] * np.dtype(dtype).itemsize:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    meta["dir"] = str(folder)
    return meta


def _write_cache(path: Path, fmt: CriteoFormat, root: Path, final: Path, chunk_lines: int) -> None:
    started = time.monotonic()
    _log.info("parsing Criteo file %s into the cache %s", path, final)
    partial = Path(tempfile.mkdtemp(prefix=f"{final.name}.partial-", dir=root))
    try:
        digests = [hashlib.sha256() for _ in _ARRAYS]
        outputs = [(partial / name).open("wb") for name, _ in _ARRAYS]
        samples = 0
        try:
            for chunk in criteo_chunks(path, fmt, chunk_lines):
                if (samples + len(chunk[0])) // _PROGRESS_EVERY > samples // _PROGRESS_EVERY:
                    _log.info("parsed %d samples of %s", samples + len(chunk[0]), path)
                samples += len(chunk[0])
                for array, out, digest in zip(chunk, outputs, digests, strict=True):
                    data = np.ascontiguousarray(array).data
                    out.write(data)
                    digest.update(data)
        finally:
            for out in outputs:
                out.close()
        if not samples:
            raise ValueError(f"Criteo file {path} holds no samples")
        shape = (samples, fmt.dense_features, len(fmt.table_rows))
        meta = {
            "source": str(path.resolve()),
            "samples": samples,
            "fingerprint": fingerprint_samples(*(d.digest() for d in digests), shape=shape),
        }
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        partial.rename(final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _log.info("parsed %d samples of %s in %.1f s", samples, path, time.monotonic() - started)


def load_criteo(recipe: dict[str, Any], fingerprint: str, source: str) -> ClickBatch:
    """The samples of a `ClickDataset.from_criteo` recipe, mapped once per process."""
    samples = _LOADED.get(fingerprint)
    if samples is not None:
        return samples
    with _LOADED_LOCK:
        samples = _LOADED.get(fingerprint)
        if samples is None:
            fmt: CriteoFormat = recipe["format"]
            try:
                meta = criteo_cache(recipe["path"], fmt, recipe["cache_dir"])
            except ValueError as err:
                raise RuntimeError(
                    f"cannot rebuild the click data ({source}) in this process: {err}. Pass a "
                    "data file that is present at the same path on every node."
                ) from err
            if meta["fingerprint"] != fingerprint:
                raise RuntimeError(
                    f"the click data differs between machines: this process parsed {source} "
                    f"into samples with fingerprint {meta['fingerprint'][:16]}, but the dataset "
                    f"was made of {fingerprint[:16]}. Pass a data file that is identical on "
                    "every node."
                )
            samples = _map_cache(Path(meta["dir"]), meta["samples"], fmt)
            _LOADED[fingerprint] = samples
    return samples


def _map_cache(folder: Path, samples: int, fmt: CriteoFormat) -> ClickBatch:
    shapes = {
        "labels": (samples,),
        "dense": (samples, fmt.dense_features),
        "sparse": (samples, len(fmt.table_rows)),
    }
    arrays = {}
    for name, dtype in _ARRAYS:
        shape = shapes[name]
        # Copy-on-write: torch wants writable arrays, and nothing may write the cache.
        arrays[name] = (
            np.memmap(folder / name, dtype=dtype, mode="c", shape=shape)
            if math.prod(shape)
            else np.zeros(shape, dtype=dtype)
        )
    return ClickBatch(**{name: torch.from_numpy(a) for name, a in arrays.items()})


def array_digest(array: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(array).data).digest()


def fingerprint_samples(
    labels: bytes, dense: bytes, sparse: bytes, *, shape: tuple[int, int, int]
) -> str:
    """Identifies samples: their shape and the SHA-256 of each array's bytes."""
    n, d, tables = shape
    digest = hashlib.sha256(f"checkfree-clicks/v1 n={n} dense={d} tables={tables}\n".encode())
    for part in (labels, dense, sparse):
        digest.update(part)
    return digest.hexdigest()
