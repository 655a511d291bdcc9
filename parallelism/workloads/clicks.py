"""Click logs for recommendation models: a synthetic generator with a planted truth, and Criteo.

`ClickLogs` generates click logs the way recommendation data looks: every sparse feature
draws its ids from a Zipf distribution (a few hot rows take most lookups), the hot ids are
scattered over the table by a fixed random permutation (as hashing scatters real ids, so
no shard holds all the hot rows), and the label is drawn from a planted logistic model
over the dense features and hidden per-row vectors (see [Note: planted click model]).
Because the truth is known, held-out log loss and AUC mean something: a model that learns
the rows gets close to the truth's own AUC (`ClickLogs.truth_logits`), and staleness of
restored rows shows up as lost accuracy.

`read_criteo` reads the Criteo TSV format (label, 13 integer features, 26 categorical
ones) into a `ClickBatch`, and `ClickDataset` serves batches from one, or, built with
`ClickDataset.from_criteo`, from a file of any size (see [Note: shipping click logs to
workers]). Both sources serve
batches the way `parallelism.workloads.data.LMBatches` does: a pure function of ``(step, replica,
microbatch)``, so a step re-run after a failure sees exactly the data it saw the first
time and the data cursor is just the step number.

[Note: planted click model]
Each table ``t`` has, for each row ``i``, a hidden vector ``z[t][i]`` (``latent_dim``
entries) and a bias ``b[t][i]``. A sample with dense features ``x`` and ids ``i_t`` has
logit::

    bias + w . x + sum_t b[t][i_t] + sum_{t < u} <z[t][i_t], z[u][i_u]>

and label ``1`` with probability ``sigmoid(logit)``. The three parts are scaled to equal
variance (``signal**2 / 3`` each, so the logit has standard deviation ``signal``): the
dense part a DLRM learns in its bottom MLP, the row biases through the dot products of
embeddings with the bottom MLP's output, the pairwise part through the dot products of
embeddings -- exactly DLRM's interaction.

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

import abc
import dataclasses
import datetime
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, get_args

import numpy as np
import torch
from torch import Tensor

from parallelism.checks import check_index, check_positive_int

__all__ = [
    "CRITEO_DENSE",
    "CRITEO_SPARSE",
    "Categorical",
    "ClickBatch",
    "ClickDataset",
    "ClickLogs",
    "read_criteo",
]

CRITEO_DENSE = 13
"""Integer (dense) features per Criteo line."""
CRITEO_SPARSE = 26
"""Categorical (sparse) features per Criteo line."""
Categorical = Literal["hash", "index"]
"""How a Criteo file names a categorical value's row (see `read_criteo`)."""

_SPLITS = {"train": 0, "val": 1}
_CHUNK_LINES = 8192
"""Criteo lines parsed at a time (about 2 MiB of arrays for Criteo's 39 features)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClickBatch:
    """Samples of click logs: dense features, sparse ids and labels, aligned on dim 0."""

    dense: Tensor
    """``[samples, dense_features]`` float32."""
    sparse: Tensor
    """``[samples, tables]`` int64: the row of each table each sample looks up."""
    labels: Tensor
    """``[samples]`` float32, 0 or 1 (click)."""

    def __post_init__(self) -> None:
        n = self.labels.shape[0] if self.labels.dim() == 1 else -1
        if (
            self.dense.dim() != 2
            or self.sparse.dim() != 2
            or self.labels.dim() != 1
            or self.dense.shape[0] != n
            or self.sparse.shape[0] != n
        ):
            raise ValueError(
                f"a click batch needs dense [n, d], sparse [n, tables] and labels [n]; got "
                f"{tuple(self.dense.shape)}, {tuple(self.sparse.shape)}, {tuple(self.labels.shape)}"
            )
        if self.sparse.dtype != torch.int64:
            raise ValueError(f"sparse ids must be int64, got {self.sparse.dtype}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def chunk(self, parts: int) -> list[ClickBatch]:
        """Split into ``parts`` consecutive batches (``torch.chunk`` sizes)."""
        return [
            ClickBatch(dense=d, sparse=s, labels=y)
            for d, s, y in zip(
                self.dense.chunk(parts),
                self.sparse.chunk(parts),
                self.labels.chunk(parts),
                strict=True,
            )
        ]

    @staticmethod
    def cat(batches: Sequence[ClickBatch]) -> ClickBatch:
        """Concatenate batches along dim 0.

        Raises:
            ValueError: if ``batches`` is empty.
        """
        if not batches:
            raise ValueError("cannot concatenate zero click batches")
        return ClickBatch(
            dense=torch.cat([b.dense for b in batches]),
            sparse=torch.cat([b.sparse for b in batches]),
            labels=torch.cat([b.labels for b in batches]),
        )


class _ClickSource(abc.ABC):
    """What both sources share: deterministic microbatches, replica batches, held-out data."""

    batch_size: int
    microbatches: int
    seed: int

    @abc.abstractmethod
    def _draw(self, split: str, key: list[int], size: int, *, fixed: bool = False) -> ClickBatch:
        """``size`` samples of ``split`` from a generator keyed by ``key``; ``fixed``: the
        held-out set of `heldout`."""

    def microbatch(
        self, step: int, replica: int, microbatch: int, *, split: str = "train"
    ) -> ClickBatch:
        """One microbatch of ``batch_size`` samples, a pure function of its arguments.

        Raises:
            ValueError: for an unknown split, a negative step or replica, or a microbatch
                outside ``0..microbatches-1``.
        """
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        check_index("step", step)
        check_index("replica", replica)
        check_index("microbatch", microbatch, self.microbatches)
        key = [self.seed, _SPLITS[split], int(step), int(replica), int(microbatch)]
        return self._draw(split, key, self.batch_size)

    def __call__(self, step: int, replica: int, num_replicas: int) -> ClickBatch:
        """The replica's batch for ``step``: its microbatches concatenated.

        Raises:
            ValueError: if ``replica`` is outside ``0..num_replicas-1`` or ``step`` < 0.
        """
        check_positive_int("num_replicas", num_replicas)
        check_index("replica", replica, num_replicas)
        return ClickBatch.cat(
            [self.microbatch(step, replica, mb) for mb in range(self.microbatches)]
        )

    def validation(self, index: int, replica: int, num_replicas: int) -> ClickBatch:
        """Held-out batch ``index`` of a replica.

        Raises:
            ValueError: if ``replica`` is outside ``0..num_replicas-1`` or ``index`` < 0.
        """
        check_positive_int("num_replicas", num_replicas)
        check_index("replica", replica, num_replicas)
        return ClickBatch.cat(
            [self.microbatch(index, replica, mb, split="val") for mb in range(self.microbatches)]
        )

    def heldout(self, samples: int) -> ClickBatch:
        """A fixed held-out set of ``samples`` samples (the same on every call).

        Raises:
            ValueError: if ``samples`` is not a positive integer.
        """
        check_positive_int("samples", samples)
        return self._draw("val", [self.seed, len(_SPLITS), samples], samples, fixed=True)


class ClickLogs(_ClickSource):
    """Synthetic click logs with Zipf-distributed ids and a planted logistic truth.

    See [Note: planted click model]. Batches are pure functions of ``(seed, split, step,
    replica, microbatch)``; the held-out split draws fresh samples from the same
    distribution with keys the training split never uses. Pickling sends only the
    arguments; the truth and the Zipf tables are rebuilt on first use.

    Args:
        table_rows: rows of each sparse feature's table.
        dense_features: dense features per sample.
        batch_size: samples per microbatch.
        microbatches: microbatches per replica per step.
        seed: seeds the truth and every batch.
        zipf_alpha: Zipf exponent of the id distributions (> 0; ~1 for click logs).
        latent_dim: entries of each row's hidden vector.
        signal: standard deviation of the true logit (larger: an easier problem).
        base_logit: the truth's intercept (sets the click rate; -1.2 gives ~0.3).

    Raises:
        ValueError: naming a bad argument.
    """

    def __init__(
        self,
        table_rows: Sequence[int],
        *,
        dense_features: int,
        batch_size: int,
        microbatches: int = 1,
        seed: int = 0,
        zipf_alpha: float = 1.05,
        latent_dim: int = 4,
        signal: float = 2.0,
        base_logit: float = -1.2,
    ) -> None:
        rows = tuple(table_rows)
        if not rows:
            raise ValueError("table_rows must name at least one table")
        for t, n in enumerate(rows):
            check_positive_int(f"table_rows[{t}]", n)
        for name, value in (
            ("dense_features", dense_features),
            ("batch_size", batch_size),
            ("microbatches", microbatches),
            ("latent_dim", latent_dim),
        ):
            check_positive_int(name, value)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        for name, number in (("zipf_alpha", zipf_alpha), ("signal", signal)):
            if not (isinstance(number, int | float) and math.isfinite(number) and number > 0):
                raise ValueError(f"{name} must be a positive number, got {number!r}")
        if not (isinstance(base_logit, int | float) and math.isfinite(base_logit)):
            raise ValueError(f"base_logit must be a finite number, got {base_logit!r}")
        self.table_rows = rows
        self.dense_features = dense_features
        self.batch_size = batch_size
        self.microbatches = microbatches
        self.seed = seed
        self.zipf_alpha = float(zipf_alpha)
        self.latent_dim = latent_dim
        self.signal = float(signal)
        self.base_logit = float(base_logit)
        self._cache: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"ClickLogs(table_rows={self.table_rows}, dense_features={self.dense_features}, "
            f"batch_size={self.batch_size}, microbatches={self.microbatches}, seed={self.seed}, "
            f"zipf_alpha={self.zipf_alpha})"
        )

    def _truth(self) -> dict[str, Any]:
        if self._cache is not None:
            return self._cache
        tables = len(self.table_rows)
        pairs = tables * (tables - 1) // 2
        part = self.signal / math.sqrt(3.0)  # std of each of the three parts
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 7, 0]))
        dense_w = rng.standard_normal(self.dense_features)
        dense_w *= part / np.linalg.norm(dense_w)
        bias_std = part / math.sqrt(tables)
        # <z, z'> of two N(0, s^2) vectors of k entries has variance k s^4.
        z_std = (part / math.sqrt(max(pairs, 1) * self.latent_dim)) ** 0.5 if pairs else 0.0
        cdfs, perms, biases, latents = [], [], [], []
        for t, n in enumerate(self.table_rows):
            trng = np.random.default_rng(np.random.SeedSequence([self.seed, 7, 1, t]))
            weights = np.arange(1, n + 1, dtype=np.float64) ** -self.zipf_alpha
            cdf = np.cumsum(weights)
            cdfs.append(cdf / cdf[-1])
            perms.append(trng.permutation(n).astype(np.int64))
            biases.append(trng.standard_normal(n) * bias_std)
            latents.append(trng.standard_normal((n, self.latent_dim)) * z_std)
        self._cache = {
            "dense_w": dense_w,
            "cdfs": cdfs,
            "perms": perms,
            "biases": biases,
            "latents": latents,
        }
        return self._cache

    def truth_logits(self, batch: ClickBatch) -> Tensor:
        """The planted model's logit for each sample (its AUC is the best any model gets).

        Raises:
            ValueError: if the batch's shape does not match these logs.
        """
        if batch.dense.shape[1] != self.dense_features or batch.sparse.shape[1] != len(
            self.table_rows
        ):
            raise ValueError(
                f"batch has {batch.dense.shape[1]} dense and {batch.sparse.shape[1]} sparse "
                f"features; these logs have {self.dense_features} and {len(self.table_rows)}"
            )
        return torch.from_numpy(
            self._logits(batch.dense.double().numpy(), batch.sparse.numpy())
        ).float()

    def _logits(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        truth = self._truth()
        logit = self.base_logit + dense @ truth["dense_w"]
        total = np.zeros((len(dense), self.latent_dim))
        squares = np.zeros(len(dense))
        for t in range(len(self.table_rows)):
            logit = logit + truth["biases"][t][sparse[:, t]]
            z = truth["latents"][t][sparse[:, t]]
            total += z
            squares += np.einsum("bk,bk->b", z, z)
        # sum over pairs t < u of <z_t, z_u> = (|sum_t z_t|^2 - sum_t |z_t|^2) / 2
        pairs = (np.einsum("bk,bk->b", total, total) - squares) / 2.0
        return np.asarray(logit + pairs, dtype=np.float64)

    def _draw(self, split: str, key: list[int], size: int, *, fixed: bool = False) -> ClickBatch:
        truth = self._truth()
        rng = np.random.default_rng(np.random.SeedSequence(key))
        dense = rng.standard_normal((size, self.dense_features))
        sparse = np.empty((size, len(self.table_rows)), dtype=np.int64)
        for t in range(len(self.table_rows)):
            ranks = np.searchsorted(truth["cdfs"][t], rng.random(size), side="right")
            ranks = np.minimum(ranks, self.table_rows[t] - 1)
            sparse[:, t] = truth["perms"][t][ranks]
        prob = 1.0 / (1.0 + np.exp(-self._logits(dense, sparse)))
        labels = (rng.random(size) < prob).astype(np.float32)
        return ClickBatch(
            dense=torch.from_numpy(dense.astype(np.float32)),
            sparse=torch.from_numpy(sparse),
            labels=torch.from_numpy(labels),
        )


class ClickDataset(_ClickSource):
    """Batches drawn from a fixed set of samples (e.g. a Criteo file), deterministically.

    The last ``val_fraction`` of the samples is held out. A microbatch is ``batch_size``
    samples drawn with replacement from the split, by a generator seeded with ``(seed,
    split, step, replica, microbatch)`` alone.

    Build one from samples in memory (``ClickDataset(samples, ...)``; pickling then sends
    the samples) or from a Criteo file with `ClickDataset.from_criteo`, which parses the
    file once into a memory-mapped cache and pickles as a recipe (see [Note: shipping
    click logs to workers]). `samples_fingerprint` identifies the samples either way (not
    the batches drawn from them, which depend on the other arguments too).

    Raises:
        ValueError: for a bad size or fraction, or too few samples to give both splits.
    """

    def __init__(
        self,
        samples: ClickBatch,
        *,
        batch_size: int,
        microbatches: int = 1,
        seed: int = 0,
        val_fraction: float = 0.1,
    ) -> None:
        _check_dataset_args(batch_size, microbatches, seed, val_fraction)
        self._setup(len(samples), batch_size, microbatches, seed, val_fraction)
        self._recipe: dict[str, Any] | None = None
        self._inline: ClickBatch | None = samples
        self.samples_fingerprint = _fingerprint(
            *(_digest(t.numpy()) for t in (samples.labels, samples.dense, samples.sparse)),
            shape=(len(samples), samples.dense.shape[1], samples.sparse.shape[1]),
        )
        self.source = f"{len(samples)} click samples in memory"

    @classmethod
    def from_criteo(
        cls,
        path: str | os.PathLike[str],
        table_rows: Sequence[int],
        *,
        batch_size: int,
        microbatches: int = 1,
        seed: int = 0,
        val_fraction: float = 0.1,
        categorical: Categorical = "hash",
        dense_features: int = CRITEO_DENSE,
        max_lines: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> ClickDataset:
        """A dataset of a Criteo-format file's samples, parsed as `read_criteo` parses them.

        The file is parsed here, once, in chunks of bounded memory, into a cache of
        ``.npy``-like raw arrays under ``cache_dir`` (default: ``$CHECKFREE_CACHE_DIR``, else
        ``$XDG_CACHE_HOME/checkfree`` or ``~/.cache/checkfree``), keyed by the file's
        absolute path, size, modification time, first MiB and the parse options; a later
        call with the same file reuses it. The samples are memory-mapped, so processes on
        one machine share one copy in the page cache. A relative ``path`` stays relative,
        so that it resolves against each worker's working directory.

        Args:
            path, table_rows, categorical, dense_features, max_lines: as in `read_criteo`.
            batch_size, microbatches, seed, val_fraction: as in `ClickDataset`.
            cache_dir: where the parsed cache lives (each machine builds its own).

        Raises:
            ValueError: as `read_criteo` does (naming ``file:line`` for a bad line) and as
                `ClickDataset` does, or if the cache folder cannot be written.
        """
        _check_dataset_args(batch_size, microbatches, seed, val_fraction)
        fmt = _criteo_format(table_rows, categorical, dense_features, max_lines)
        recipe: dict[str, Any] = {
            "path": os.fspath(path),
            "format": fmt,
            "cache_dir": None if cache_dir is None else os.fspath(cache_dir),
        }
        meta = _criteo_cache(recipe["path"], fmt, recipe["cache_dir"])
        self = cls.__new__(cls)
        self._setup(meta["samples"], batch_size, microbatches, seed, val_fraction)
        self._recipe = recipe
        self._inline = None
        self.samples_fingerprint = meta["fingerprint"]
        self.source = f"Criteo file {recipe['path']} ({meta['samples']} samples)"
        return self

    def _setup(
        self, samples: int, batch_size: int, microbatches: int, seed: int, val_fraction: float
    ) -> None:
        n_val = max(1, round(samples * val_fraction))
        if samples - n_val < 1:
            raise ValueError(f"{samples} samples are too few for a training and a held-out part")
        self.batch_size = batch_size
        self.microbatches = microbatches
        self.seed = seed
        self._count = samples
        self._split_at = samples - n_val

    @property
    def samples(self) -> ClickBatch:
        """Every sample, training part first (memory-mapped for `from_criteo`).

        Raises:
            RuntimeError: if this process cannot rebuild the samples of `from_criteo` (the
                file is missing here) or they differ from the ones the dataset was made of.
        """
        if self._inline is not None:
            return self._inline
        assert self._recipe is not None
        return _load_criteo(self._recipe, self.samples_fingerprint, self.source)

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return (
            f"ClickDataset({self.source}, batch_size={self.batch_size}, "
            f"microbatches={self.microbatches}, seed={self.seed}, "
            f"samples_fingerprint={self.samples_fingerprint[:12]})"
        )

    def _draw(self, split: str, key: list[int], size: int, *, fixed: bool = False) -> ClickBatch:
        lo, hi = (0, self._split_at) if split == "train" else (self._split_at, self._count)
        if fixed:  # the fixed held-out set: the held-out samples in order, cycling
            index = torch.arange(size) % (hi - lo) + lo
        else:
            rng = np.random.default_rng(np.random.SeedSequence(key))
            index = torch.from_numpy(rng.integers(lo, hi, size=size))
        s = self.samples
        return ClickBatch(dense=s.dense[index], sparse=s.sparse[index], labels=s.labels[index])


def _check_dataset_args(batch_size: int, microbatches: int, seed: int, val_fraction: float) -> None:
    check_positive_int("batch_size", batch_size)
    check_positive_int("microbatches", microbatches)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not (isinstance(val_fraction, int | float) and 0 < val_fraction < 1):
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")


# ---- Criteo ----------------------------------------------------------------------------


def read_criteo(
    path: str | os.PathLike[str],
    table_rows: Sequence[int],
    *,
    categorical: Categorical = "hash",
    dense_features: int = CRITEO_DENSE,
    max_lines: int | None = None,
    chunk_lines: int = _CHUNK_LINES,
) -> ClickBatch:
    """Read a Criteo-format TSV file: ``label, dense..., categorical...`` per line.

    Dense (integer) values become ``log(1 + max(x, 0))`` as DLRM preprocesses them; an
    empty value is 0. Categorical values become rows of their table:

    - ``categorical="hash"`` (the raw Criteo files): a hexadecimal string, row
      ``int(value, 16) % table_rows[t]``; an empty value is row 0.
    - ``categorical="index"`` (preprocessed files): a decimal row index, which must lie in
      ``0..table_rows[t]-1``; an empty value is row 0.

    Lines end at ``\\n``, ``\\r\\n`` or ``\\r``; empty lines are skipped (and counted). The file
    is parsed ``chunk_lines`` lines at a time into compact arrays (about 4 + 4 * dense + 8 *
    tables bytes a sample, e.g. 264 for Criteo; the peak is twice that, while the chunks are
    joined), and the whole file is parsed before anything is returned, so a bad line leaves
    nothing half-read behind. For a file too large for memory use
    `ClickDataset.from_criteo`, which memory-maps a cache on disk.

    Args:
        path: the file.
        table_rows: rows of each categorical feature's table (26 for Criteo).
        categorical: ``"hash"`` or ``"index"``, as above.
        dense_features: integer features per line (13 for Criteo).
        max_lines: read at most this many lines.
        chunk_lines: lines parsed at a time.

    Raises:
        ValueError: for a missing or empty file, a bad argument, or a malformed line -- not
            UTF-8, a wrong number of fields, a label other than 0/1, a non-integer dense
            value, a non-hexadecimal (hash) or non-decimal (index) categorical value, or an
            index outside its table -- naming ``file:line`` and the feature.
    """
    fmt = _criteo_format(table_rows, categorical, dense_features, max_lines)
    check_positive_int("chunk_lines", chunk_lines)
    chunks = list(_criteo_chunks(_criteo_path(path), fmt, chunk_lines))
    if not chunks:
        raise ValueError(f"Criteo file {path} holds no samples")
    labels, dense, sparse = (np.concatenate([c[i] for c in chunks]) for i in range(3))
    return ClickBatch(
        dense=torch.from_numpy(dense),
        sparse=torch.from_numpy(sparse),
        labels=torch.from_numpy(labels),
    )


@dataclass(frozen=True)
class _CriteoFormat:
    """How to parse a Criteo file (`read_criteo`'s options), checked."""

    table_rows: tuple[int, ...]
    categorical: Categorical
    dense_features: int
    max_lines: int | None


def _criteo_format(
    table_rows: Sequence[int], categorical: Categorical, dense_features: int, max_lines: int | None
) -> _CriteoFormat:
    if categorical not in get_args(Categorical):
        raise ValueError(f"categorical must be 'hash' or 'index', got {categorical!r}")
    rows = tuple(table_rows)
    if not rows:
        raise ValueError("table_rows must name at least one table")
    for t, n in enumerate(rows):
        check_positive_int(f"table_rows[{t}]", n)
    if isinstance(dense_features, bool) or not isinstance(dense_features, int):
        raise ValueError(f"dense_features must be an integer, got {dense_features!r}")
    if dense_features < 0:
        raise ValueError(f"dense_features must be >= 0, got {dense_features}")
    if max_lines is not None:
        check_positive_int("max_lines", max_lines)
    return _CriteoFormat(tuple(int(n) for n in rows), categorical, dense_features, max_lines)


def _criteo_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"Criteo file {path} does not exist (resolved to {p.absolute()})")
    return p


# A lone "\r" ends a line too (as text mode with newline="" splits), but "\r\n" is one end.
_LONE_CR = re.compile(rb"(?<=\r)(?!\n)")

_Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]
"""``(labels [n] float32, dense [n, d] float32, sparse [n, tables] int64)``."""


def _criteo_chunks(path: Path, fmt: _CriteoFormat, chunk_lines: int) -> Iterator[_Chunk]:
    """The samples of a Criteo file, at most ``chunk_lines`` at a time, in file order.

    Raises:
        ValueError: for a malformed line, naming ``file:line`` (see `read_criteo`).
    """
    d, tables = fmt.dense_features, len(fmt.table_rows)
    fields = 1 + d + tables

    def fresh() -> _Chunk:
        return (
            np.empty(chunk_lines, dtype=np.float32),
            np.empty((chunk_lines, d), dtype=np.float32),
            np.empty((chunk_lines, tables), dtype=np.int64),
        )

    labels, dense, sparse = fresh()
    k = 0
    with path.open("rb") as handle:
        for number, raw in _numbered_lines(handle, fmt.max_lines):
            if not raw:
                continue
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{where}: invalid UTF-8 at byte {err.start + 1} of the line "
                    f"({raw[err.start : err.start + 4]!r}...); a Criteo file is UTF-8 text"
                ) from None
            parts = line.split("\t")
            if len(parts) != fields:
                raise ValueError(
                    f"{where}: {len(parts)} tab-separated fields, expected {fields} (label, "
                    f"{d} integer and {tables} categorical features)"
                )
            if parts[0] not in ("0", "1"):
                raise ValueError(f"{where}: label {parts[0]!r} is not 0 or 1")
            labels[k] = float(parts[0])
            dense[k] = _dense_values(parts[1 : 1 + d], where)
            sparse[k] = _categories(parts[1 + d :], fmt, where)
            k += 1
            if k == chunk_lines:
                yield labels, dense, sparse
                labels, dense, sparse = fresh()
                k = 0
    if k:
        yield labels[:k], dense[:k], sparse[:k]


def _numbered_lines(handle: BinaryIO, max_lines: int | None) -> Iterator[tuple[int, bytes]]:
    """``(line number, line without its end)`` for the first ``max_lines`` lines."""
    number = 0
    for raw in handle:
        for piece in _LONE_CR.split(raw) if b"\r" in raw else (raw,):
            if not piece:  # after a "\r" that ends the file
                continue
            number += 1
            if max_lines is not None and number > max_lines:
                return
            yield number, piece.rstrip(b"\r\n")


def _dense_values(texts: list[str], where: str) -> list[float]:
    try:
        return [math.log1p(max(int(text), 0)) if text else 0.0 for text in texts]
    except (ValueError, OverflowError):
        pass
    for j, text in enumerate(texts):  # find the bad one
        try:
            if text:
                math.log1p(max(int(text), 0))
        except ValueError:
            raise ValueError(
                f"{where}: integer feature I{j + 1} = {text!r} is not an integer"
            ) from None
        except OverflowError:
            raise ValueError(
                f"{where}: integer feature I{j + 1} = {text[:20]}... is too large for a float"
            ) from None
    raise AssertionError("unreachable: a value failed to parse, then parsed")


def _categories(texts: list[str], fmt: _CriteoFormat, where: str) -> list[int]:
    rows = fmt.table_rows
    if fmt.categorical == "hash":
        try:
            return [int(text, 16) % n if text else 0 for text, n in zip(texts, rows, strict=True)]
        except ValueError:
            pass
    return [_category(text, rows[t], fmt.categorical, where, t) for t, text in enumerate(texts)]


def _category(text: str, rows: int, mode: str, where: str, table: int) -> int:
    if not text:
        return 0
    if mode == "hash":
        try:
            return int(text, 16) % rows
        except ValueError:
            raise ValueError(
                f"{where}: categorical feature C{table + 1} = {text!r} is not hexadecimal"
            ) from None
    try:
        value = int(text, 10)
    except ValueError:
        raise ValueError(
            f"{where}: categorical feature C{table + 1} = {text!r} is not a decimal row index"
        ) from None
    if not 0 <= value < rows:
        raise ValueError(
            f"{where}: categorical feature C{table + 1} = {value} is outside its table of "
            f"{rows} rows (0..{rows - 1}); pass larger table_rows or categorical='hash'"
        )
    return value


# ---- the on-disk cache of a parsed Criteo file (see [Note: shipping click logs to workers])


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


def _cache_key(path: Path, fmt: _CriteoFormat) -> str:
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


def _criteo_cache(
    path: str, fmt: _CriteoFormat, cache_dir: str | None, chunk_lines: int = _CHUNK_LINES
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
    p = _criteo_path(path)
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


def _read_meta(folder: Path, fmt: _CriteoFormat) -> dict[str, Any] | None:
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


def _write_cache(path: Path, fmt: _CriteoFormat, root: Path, final: Path, chunk_lines: int) -> None:
    started = time.monotonic()
    _log.info("parsing Criteo file %s into the cache %s", path, final)
    partial = Path(tempfile.mkdtemp(prefix=f"{final.name}.partial-", dir=root))
    try:
        digests = [hashlib.sha256() for _ in _ARRAYS]
        outputs = [(partial / name).open("wb") for name, _ in _ARRAYS]
        samples = 0
        try:
            for chunk in _criteo_chunks(path, fmt, chunk_lines):
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
            "fingerprint": _fingerprint(*(d.digest() for d in digests), shape=shape),
        }
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        partial.rename(final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _log.info("parsed %d samples of %s in %.1f s", samples, path, time.monotonic() - started)


def _load_criteo(recipe: dict[str, Any], fingerprint: str, source: str) -> ClickBatch:
    """The samples of a `ClickDataset.from_criteo` recipe, mapped once per process."""
    samples = _LOADED.get(fingerprint)
    if samples is not None:
        return samples
    with _LOADED_LOCK:
        samples = _LOADED.get(fingerprint)
        if samples is None:
            fmt: _CriteoFormat = recipe["format"]
            try:
                meta = _criteo_cache(recipe["path"], fmt, recipe["cache_dir"])
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


def _map_cache(folder: Path, samples: int, fmt: _CriteoFormat) -> ClickBatch:
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


def _digest(array: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(array).data).digest()


def _fingerprint(labels: bytes, dense: bytes, sparse: bytes, *, shape: tuple[int, int, int]) -> str:
    """Identifies samples: their shape and the SHA-256 of each array's bytes."""
    n, d, tables = shape
    digest = hashlib.sha256(f"checkfree-clicks/v1 n={n} dense={d} tables={tables}\n".encode())
    for part in (labels, dense, sparse):
        digest.update(part)
    return digest.hexdigest()
