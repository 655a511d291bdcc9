"""The DLRM model itself: its sizes (`DLRMConfig`), the initial embedding rows, the dense
part (`DenseDLRM`), the row-wise Adagrad of the tables, and `DLRM`, the whole model
unsharded in one process -- the reference the sharded workers must match -- with the
metrics both are judged by (`roc_auc`, `log_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallelism.checks import check_positive_int
from parallelism.seeding import derive_seed, seed_everything
from parallelism.workloads.clicks import ClickBatch

__all__ = [
    "DLRM",
    "DLRMConfig",
    "DenseDLRM",
    "dlrm_loss",
    "init_table_rows",
    "log_loss",
    "predict_unsharded",
    "roc_auc",
    "rowwise_adagrad_",
]

_INIT_CHUNK = 8192  # rows per independently seeded init chunk (see init_table_rows)


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """Sizes of a DLRM-style model.

    Raises:
        ValueError: naming a bad field and value.
    """

    table_rows: tuple[int, ...]
    """Rows of each sparse feature's embedding table (one table per feature)."""
    embedding_dim: int = 16
    """Width of every embedding row (and of the bottom MLP's output)."""
    dense_features: int = 13
    """Dense (continuous) input features per sample."""
    bottom_mlp: tuple[int, ...] = (64,)
    """Hidden widths of the bottom MLP; a last layer to ``embedding_dim`` is added."""
    top_mlp: tuple[int, ...] = (64, 32)
    """Hidden widths of the top MLP; a last layer to one logit is added."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "table_rows", tuple(self.table_rows))
        object.__setattr__(self, "bottom_mlp", tuple(self.bottom_mlp))
        object.__setattr__(self, "top_mlp", tuple(self.top_mlp))
        if not self.table_rows:
            raise ValueError("DLRMConfig.table_rows must name at least one table")
        for t, rows in enumerate(self.table_rows):
            check_positive_int(f"DLRMConfig.table_rows[{t}]", rows)
        check_positive_int("DLRMConfig.embedding_dim", self.embedding_dim)
        check_positive_int("DLRMConfig.dense_features", self.dense_features)
        for name in ("bottom_mlp", "top_mlp"):
            for i, width in enumerate(getattr(self, name)):
                check_positive_int(f"DLRMConfig.{name}[{i}]", width)

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    @property
    def interaction_dim(self) -> int:
        """Width of the top MLP's input: the bottom output and the pairwise dot products."""
        vectors = self.num_tables + 1
        return self.embedding_dim + vectors * (vectors - 1) // 2

    @property
    def embedding_rows(self) -> int:
        return sum(self.table_rows)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DLRMConfig:
        """A named size: ``"tiny"`` (tests: 4 tables of 12-40 rows, dim 4) or ``"small"``
        (experiments: 8 tables, 387,500 rows in all, dim 16; trains on a 2-core CPU in
        minutes).

        Raises:
            ValueError: for an unknown preset or a bad override.
        """
        presets: dict[str, dict[str, Any]] = {
            "tiny": {
                "table_rows": (40, 30, 20, 12),
                "embedding_dim": 4,
                "dense_features": 3,
                "bottom_mlp": (8,),
                "top_mlp": (8,),
            },
            "small": {
                "table_rows": (200_000, 100_000, 50_000, 20_000, 10_000, 5_000, 2_000, 500),
                "embedding_dim": 16,
                "dense_features": 13,
                "bottom_mlp": (64,),
                "top_mlp": (64, 32),
            },
        }
        if name not in presets:
            raise ValueError(f"unknown DLRM preset {name!r}; choose one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})


def init_table_rows(seed: int, table: int, rows: int, start: int, stop: int, dim: int) -> Tensor:
    """Initial values of rows ``start..stop-1`` of a table of ``rows`` rows.

    DLRM's initialisation, uniform in ``+-sqrt(1/rows)``, drawn in chunks of 8192 rows each
    seeded by ``(seed, table, chunk)``, so a row's initial value does not depend on how
    the table is sharded: a shard and the unsharded reference start equal.
    """
    scale = math.sqrt(1.0 / rows)
    out = torch.empty(stop - start, dim)
    for chunk in range(start // _INIT_CHUNK, (stop - 1) // _INIT_CHUNK + 1 if stop > start else 0):
        lo, hi = chunk * _INIT_CHUNK, min((chunk + 1) * _INIT_CHUNK, rows)
        gen = torch.Generator().manual_seed(derive_seed(seed, "embedding", table, chunk))
        values = torch.rand(hi - lo, dim, generator=gen) * (2 * scale) - scale
        a, b = max(lo, start), min(hi, stop)
        out[a - start : b - start] = values[a - lo : b - lo]
    return out


def rowwise_adagrad_(
    weight: Tensor, accumulator: Tensor, rows: Tensor, grads: Tensor, *, lr: float, eps: float
) -> None:
    """Row-wise Adagrad (DLRM's sparse optimizer, no weight decay) on ``rows`` only, in place.

    ``accumulator[r] += mean(g_r ** 2)``; ``weight[r] -= lr * g_r / (sqrt(accumulator[r]) +
    eps)``. ``rows`` must be unique. Rows not listed are not touched at all.
    """
    with torch.no_grad():
        acc = accumulator[rows] + grads.pow(2).mean(dim=1)
        accumulator[rows] = acc
        weight[rows] = weight[rows] - lr * grads / (acc.sqrt() + eps)[:, None]


def _mlp(widths: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseDLRM(nn.Module):
    """The data-parallel part: bottom MLP, dot-product interaction, top MLP."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        d = config.embedding_dim
        self.bottom = _mlp((config.dense_features, *config.bottom_mlp, d), last_relu=True)
        self.top = _mlp((config.interaction_dim, *config.top_mlp, 1), last_relu=False)
        li, lj = torch.tril_indices(config.num_tables + 1, config.num_tables + 1, offset=-1)
        self.pairs: Tensor
        self.register_buffer("pairs", torch.stack([li, lj]), persistent=False)

    def forward(self, dense: Tensor, embeddings: Tensor) -> Tensor:
        """Logits ``[B]`` from dense features ``[B, dense]`` and embeddings ``[B, T, dim]``."""
        z = self.bottom(dense)
        vectors = torch.cat([z[:, None, :], embeddings], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        interaction = dots[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([z, interaction], dim=1)).squeeze(1)


def _build_dense(config: DLRMConfig, seed: int) -> DenseDLRM:
    seed_everything(seed, "dlrm-dense")
    return DenseDLRM(config)


def _dense_optimizer(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=lr)


def dlrm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean binary cross-entropy of click logits against labels."""
    return F.binary_cross_entropy_with_logits(logits, labels)


class DLRM(nn.Module):
    """The whole model in one process, tables unsharded: what the sharded workers must match.

    Same initial weights as `DLRMWorker`s with the same seed, same optimizers; trained on
    the concatenation of the workers' batches it gives the same weights, up to the order
    of floating-point sums.
    """

    def __init__(
        self,
        config: DLRMConfig,
        *,
        seed: int = 0,
        sparse_lr: float = 0.05,
        dense_lr: float = 1e-3,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.config = config
        self.tables = nn.ParameterList(
            nn.Parameter(init_table_rows(seed, t, n, 0, n, config.embedding_dim))
            for t, n in enumerate(config.table_rows)
        )
        self.accumulators = [torch.zeros(n) for n in config.table_rows]
        self.dense = _build_dense(config, seed)
        self.dense_optimizer = _dense_optimizer(self.dense, dense_lr)
        self.sparse_lr = sparse_lr
        self.eps = eps

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        embeddings = torch.stack(
            [table[sparse[:, t]] for t, table in enumerate(self.tables)], dim=1
        )
        return self.dense(dense, embeddings)

    def train_step(self, batch: ClickBatch) -> float:
        """One step on ``batch`` (mean loss); returns the mean loss."""
        self.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(self(batch.dense, batch.sparse), batch.labels)
        loss.backward()
        for t, table in enumerate(self.tables):
            rows = torch.unique(batch.sparse[:, t])
            assert table.grad is not None
            rowwise_adagrad_(
                table.data,
                self.accumulators[t],
                rows,
                table.grad[rows],
                lr=self.sparse_lr,
                eps=self.eps,
            )
        self.dense_optimizer.step()
        return float(loss.detach())


def predict_unsharded(
    dense: nn.Module, tables: Sequence[Tensor], batch: ClickBatch, *, chunk: int = 8192
) -> Tensor:
    """Logits of ``batch`` from full tables and a dense replica, in chunks (no gradients)."""
    outs = []
    with torch.no_grad():
        for part in batch.chunk(max(1, math.ceil(len(batch) / chunk))):
            emb = torch.stack([tab[part.sparse[:, t]] for t, tab in enumerate(tables)], dim=1)
            outs.append(dense(part.dense, emb))
    return torch.cat(outs)


# ---- metrics ---------------------------------------------------------------------------


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (ties count one half), from ranks.

    Raises:
        ValueError: if the shapes differ or ``labels`` hold only one class.
    """
    if scores.shape != labels.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} differ")
    positives = int((labels > 0.5).sum())
    negatives = int(labels.numel()) - positives
    if positives == 0 or negatives == 0:
        raise ValueError("AUC needs both positive and negative labels")
    order = torch.argsort(scores.double())
    _, inverse, counts = torch.unique_consecutive(
        scores.double()[order], return_inverse=True, return_counts=True
    )
    ends = torch.cumsum(counts, 0).double()
    average = (ends - counts.double() + 1 + ends) / 2  # mean 1-based rank of each tie group
    ranks = torch.empty(scores.numel(), dtype=torch.float64)
    ranks[order] = average[inverse]
    rank_sum = float(ranks[labels > 0.5].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def log_loss(logits: Tensor, labels: Tensor) -> float:
    """Mean binary cross-entropy of ``sigmoid(logits)`` against ``labels``."""
    return float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))
