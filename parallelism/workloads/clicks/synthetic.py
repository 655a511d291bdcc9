"""Synthetic click logs with a planted truth (`ClickLogs`).

`ClickLogs` generates click logs the way recommendation data looks: every sparse feature
draws its ids from a Zipf distribution (a few hot rows take most lookups), the hot ids are
scattered over the table by a fixed random permutation (as hashing scatters real ids, so
no shard holds all the hot rows), and the label is drawn from a planted logistic model
over the dense features and hidden per-row vectors (see [Note: planted click model]).
Because the truth is known, held-out log loss and AUC mean something: a model that learns
the rows gets close to the truth's own AUC (`ClickLogs.truth_logits`), and staleness of
restored rows shows up as lost accuracy.

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

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from parallelism.checks import check_positive_int
from parallelism.workloads.clicks.batch import ClickBatch, ClickSource

__all__ = ["ClickLogs"]


class ClickLogs(ClickSource):
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
