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
ones) into a `ClickBatch`, and `ClickDataset` serves batches from one. Both sources serve
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
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from parallelism.checks import check_index, check_positive_int

__all__ = [
    "CRITEO_DENSE",
    "CRITEO_SPARSE",
    "ClickBatch",
    "ClickDataset",
    "ClickLogs",
    "read_criteo",
]

CRITEO_DENSE = 13
"""Integer (dense) features per Criteo line."""
CRITEO_SPARSE = 26
"""Categorical (sparse) features per Criteo line."""

_SPLITS = {"train": 0, "val": 1}


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
    """Batches drawn from a fixed set of samples (e.g. `read_criteo`'s), deterministically.

    The last ``val_fraction`` of the samples is held out. A microbatch is ``batch_size``
    samples drawn with replacement from the split, by a generator seeded with ``(seed,
    split, step, replica, microbatch)`` alone.

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
        check_positive_int("batch_size", batch_size)
        check_positive_int("microbatches", microbatches)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if not (isinstance(val_fraction, int | float) and 0 < val_fraction < 1):
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        n_val = max(1, round(len(samples) * val_fraction))
        if len(samples) - n_val < 1:
            raise ValueError(
                f"{len(samples)} samples are too few for a training and a held-out part"
            )
        self.samples = samples
        self.batch_size = batch_size
        self.microbatches = microbatches
        self.seed = seed
        self._split_at = len(samples) - n_val

    def _draw(self, split: str, key: list[int], size: int, *, fixed: bool = False) -> ClickBatch:
        lo, hi = (0, self._split_at) if split == "train" else (self._split_at, len(self.samples))
        if fixed:  # the fixed held-out set: the held-out samples in order, cycling
            index = torch.arange(size) % (hi - lo) + lo
        else:
            rng = np.random.default_rng(np.random.SeedSequence(key))
            index = torch.from_numpy(rng.integers(lo, hi, size=size))
        s = self.samples
        return ClickBatch(dense=s.dense[index], sparse=s.sparse[index], labels=s.labels[index])


def read_criteo(
    path: str | os.PathLike[str],
    table_rows: Sequence[int],
    *,
    categorical: str = "hash",
    dense_features: int = CRITEO_DENSE,
    max_lines: int | None = None,
) -> ClickBatch:
    """Read a Criteo-format TSV file: ``label, dense..., categorical...`` per line.

    Dense (integer) values become ``log(1 + max(x, 0))`` as DLRM preprocesses them; an
    empty value is 0. Categorical values become rows of their table:

    - ``categorical="hash"`` (the raw Criteo files): a hexadecimal string, row
      ``int(value, 16) % table_rows[t]``; an empty value is row 0.
    - ``categorical="index"`` (preprocessed files): a decimal row index, which must lie in
      ``0..table_rows[t]-1``; an empty value is row 0.

    The whole file is parsed before anything is returned, so a bad line leaves nothing
    half-read behind.

    Args:
        path: the file.
        table_rows: rows of each categorical feature's table (26 for Criteo).
        categorical: ``"hash"`` or ``"index"``, as above.
        dense_features: integer features per line (13 for Criteo).
        max_lines: read at most this many lines.

    Raises:
        ValueError: for a missing or empty file, a bad argument, or a malformed line -- a
            wrong number of fields, a label other than 0/1, a non-integer dense value, a
            non-hexadecimal (hash) or non-decimal (index) categorical value, or an index
            outside its table -- naming ``file:line`` and the feature.
    """
    if categorical not in ("hash", "index"):
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
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"Criteo file {path} does not exist (resolved to {p.absolute()})")
    fields = 1 + dense_features + len(rows)
    labels: list[float] = []
    dense: list[list[float]] = []
    sparse: list[list[int]] = []
    with p.open(encoding="utf-8", newline="") as handle:
        for number, raw in enumerate(handle, start=1):
            if max_lines is not None and number > max_lines:
                break
            line = raw.rstrip("\r\n")
            if not line:
                continue
            where = f"{path}:{number}"
            parts = line.split("\t")
            if len(parts) != fields:
                raise ValueError(
                    f"{where}: {len(parts)} tab-separated fields, expected {fields} (label, "
                    f"{dense_features} integer and {len(rows)} categorical features)"
                )
            if parts[0] not in ("0", "1"):
                raise ValueError(f"{where}: label {parts[0]!r} is not 0 or 1")
            labels.append(float(parts[0]))
            values = []
            for j, text in enumerate(parts[1 : 1 + dense_features]):
                try:
                    x = int(text) if text else 0
                except ValueError:
                    raise ValueError(
                        f"{where}: integer feature I{j + 1} = {text!r} is not an integer"
                    ) from None
                values.append(math.log1p(max(x, 0)))
            dense.append(values)
            ids = []
            for t, text in enumerate(parts[1 + dense_features :]):
                ids.append(_category(text, rows[t], categorical, where, t))
            sparse.append(ids)
    if not labels:
        raise ValueError(f"Criteo file {path} holds no samples")
    return ClickBatch(
        dense=torch.tensor(dense, dtype=torch.float32).reshape(len(labels), dense_features),
        sparse=torch.tensor(sparse, dtype=torch.int64),
        labels=torch.tensor(labels, dtype=torch.float32),
    )


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
