"""Click batches drawn from a fixed set of samples (`ClickDataset`): samples in memory, or a
Criteo file of any size parsed once per machine into a memory-mapped cache
(`ClickDataset.from_criteo`, see [Note: shipping click logs to workers] in
`parallelism.workloads.clicks.cache`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from parallelism.checks import check_positive_int
from parallelism.workloads.clicks.batch import ClickBatch, ClickSource
from parallelism.workloads.clicks.cache import (
    array_digest,
    criteo_cache,
    fingerprint_samples,
    load_criteo,
)
from parallelism.workloads.clicks.criteo import CRITEO_DENSE, Categorical, criteo_format

__all__ = ["ClickDataset"]


class ClickDataset(ClickSource):
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
        self.samples_fingerprint = fingerprint_samples(
            *(array_digest(t.numpy()) for t in (samples.labels, samples.dense, samples.sparse)),
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
        fmt = criteo_format(table_rows, categorical, dense_features, max_lines)
        recipe: dict[str, Any] = {
            "path": os.fspath(path),
            "format": fmt,
            "cache_dir": None if cache_dir is None else os.fspath(cache_dir),
        }
        meta = criteo_cache(recipe["path"], fmt, recipe["cache_dir"])
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
        return load_criteo(self._recipe, self.samples_fingerprint, self.source)

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
