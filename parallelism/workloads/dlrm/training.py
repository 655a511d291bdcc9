"""A DLRM-style recommendation model whose embedding tables are row-sharded over the workers.

The model (Naumov et al., 2019): every sparse feature looks up one row of its embedding
table; a bottom MLP maps the dense features to a vector of the same width; the pairwise
dot products of these ``T + 1`` vectors, with the bottom output, feed a top MLP that gives
the click logit. Most parameters are in the tables, so they are *model-parallel*: the rows
of every table are split over all ``W`` workers (`ShardLayout`), each worker holding its
rows of every table in one `EmbeddingShard`. The MLPs (`DenseDLRM`) are small and
*data-parallel*: every worker holds a replica and the gradients are all-reduced.

One training step of one worker (`DLRMWorker`), see [Note: embedding exchange]: route the
ids of its batch to their owners, exchange requests and rows with two all-to-alls, run the
dense part, send the gradients of the looked-up rows back to their owners (a third
all-to-all), all-reduce the dense gradients, and -- on commit -- apply row-wise Adagrad to
the touched rows only (rows not looked up stay bit-identical) and Adam to the dense part.
The exchanges go through a tiny `Collective` interface with two implementations:
`LocalGroup` (W workers as threads of one process, for tests and experiments) and
`ProcessGroupCollective` (a ``torch.distributed`` Gloo or NCCL process group). `DLRM` is
the same model unsharded in one process, the reference the sharded trainer must match;
`InProcessDLRM` runs W sharded workers in one process.

[Note: row sharding]
Rows are split per table into contiguous, balanced ranges: shard ``s`` of a table of
``n`` rows owns rows ``floor(s n / W) .. floor((s+1) n / W) - 1``, so the owner of row
``r`` is ``((r + 1) W - 1) // n``. A shard stores its rows of all tables in one flat
``[rows, dim]`` parameter, table after table (``ShardLayout.offsets``), so a lost shard is
one tensor to mirror, snapshot and restore, and a local row index names one row. Hot
rows land on every shard because ids are hashed (or, in `parallelism.clicks`, permuted)
over the table, not because of the layout.

[Note: embedding exchange]
Every worker routes its ``B x T`` ids: it maps each ``(table, id)`` to ``(owner, local
row)``, deduplicates, and sends owner ``d`` the sorted unique local rows it needs with
the number of lookups of each (``[n_d, 2]`` int64). Owners answer with the rows
(``[n_d, dim]``); the requester stacks the answers into one leaf tensor and gathers the
``[B, T, dim]`` embeddings from it, so autograd sums the gradients of repeated ids. After
backward the leaf's gradient goes back to the owners in the same split, and each owner
sums what it receives per local row, in source order (deterministic). The loss of a
worker is its sample sum divided by ``W * B``, so the sums over workers are gradients of
the mean over the global batch. The lookup counts are what recovery bookkeeping needs
(`recovery.strategies.embedding`): which rows a step updated, and how many samples'
updates each row carries.
"""

from __future__ import annotations

import copy
import datetime
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallelism.clicks import ClickBatch
from parallelism.seeding import derive_seed, seed_everything

__all__ = [
    "DLRM",
    "Collective",
    "DLRMConfig",
    "DLRMTraining",
    "DLRMWorker",
    "DenseDLRM",
    "EmbeddingShard",
    "InProcessDLRM",
    "LocalGroup",
    "ProcessGroupCollective",
    "Routing",
    "ShardLayout",
    "StepLoss",
    "StepUpdate",
    "assemble_tables",
    "dlrm_loss",
    "init_table_rows",
    "log_loss",
    "predict_unsharded",
    "roc_auc",
    "route_lookups",
    "rowwise_adagrad_",
]

_INIT_CHUNK = 8192  # rows per independently seeded init chunk (see init_table_rows)


# ---- configuration ---------------------------------------------------------------------


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
            _positive_int(f"DLRMConfig.table_rows[{t}]", rows)
        _positive_int("DLRMConfig.embedding_dim", self.embedding_dim)
        _positive_int("DLRMConfig.dense_features", self.dense_features)
        for name in ("bottom_mlp", "top_mlp"):
            for i, width in enumerate(getattr(self, name)):
                _positive_int(f"DLRMConfig.{name}[{i}]", width)

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


# ---- row sharding ----------------------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """Which worker owns which embedding rows. See [Note: row sharding].

    Raises:
        ValueError: if ``num_shards`` is not a positive integer, a table size is not a
            positive integer, or a table has fewer rows than there are shards (some shard
            would own none of its rows).
    """

    table_rows: tuple[int, ...]
    num_shards: int
    _bounds: Tensor = field(init=False, repr=False, compare=False)
    _offsets: Tensor = field(init=False, repr=False, compare=False)
    _stride: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "table_rows", tuple(self.table_rows))
        _positive_int("num_shards", self.num_shards)
        if not self.table_rows:
            raise ValueError("a shard layout needs at least one table")
        for t, rows in enumerate(self.table_rows):
            _positive_int(f"table_rows[{t}]", rows)
            if rows < self.num_shards:
                raise ValueError(
                    f"table {t} has {rows} rows, fewer than the {self.num_shards} shards: "
                    f"every shard must own at least one row of every table; use at most "
                    f"{rows} workers or a larger table"
                )
        w = self.num_shards
        rows_t = torch.tensor(self.table_rows, dtype=torch.int64)
        bounds = torch.arange(w + 1, dtype=torch.int64)[None, :] * rows_t[:, None] // w  # [T, W+1]
        sizes = (bounds[:, 1:] - bounds[:, :-1]).T  # [W, T]
        offsets = torch.cumsum(sizes, dim=1) - sizes  # [W, T]: table t's first local row
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_stride", int(sizes.sum(dim=1).max()))

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def shard_rows(self, shard: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of the rows ``shard`` owns in each table.

        Raises:
            ValueError: if ``shard`` is outside ``0..num_shards-1``.
        """
        self._check_shard(shard)
        return tuple(
            (int(self._bounds[t, shard]), int(self._bounds[t, shard + 1]))
            for t in range(self.num_tables)
        )

    def shard_size(self, shard: int) -> int:
        """Rows ``shard`` owns over all tables (the length of its flat weight)."""
        return sum(stop - start for start, stop in self.shard_rows(shard))

    def offsets(self, shard: int) -> tuple[int, ...]:
        """Where each table's rows start in ``shard``'s flat weight."""
        self._check_shard(shard)
        return tuple(int(o) for o in self._offsets[shard])

    def owner(self, table: int, rows: Tensor) -> Tensor:
        """The shard owning each of ``rows`` (ids of ``table``), elementwise.

        Raises:
            ValueError: if ``table`` is unknown or a row is outside the table.
        """
        return self._locate_table(table, rows)[0]

    def local_index(self, table: int, rows: Tensor) -> Tensor:
        """Each row's index in its owner's flat weight.

        Raises:
            ValueError: if ``table`` is unknown or a row is outside the table.
        """
        return self._locate_table(table, rows)[1]

    def locate(self, sparse: Tensor) -> tuple[Tensor, Tensor]:
        """``(owner, local index)`` of every id of a ``[B, T]`` batch, one column per table.

        Raises:
            ValueError: if ``sparse`` is not ``[B, T]`` int64, or an id is outside its
                table (naming the table and the id).
        """
        if sparse.dim() != 2 or sparse.shape[1] != self.num_tables or sparse.dtype != torch.int64:
            raise ValueError(
                f"sparse ids must be [batch, {self.num_tables}] int64, got "
                f"{tuple(sparse.shape)} {sparse.dtype}"
            )
        rows = torch.tensor(self.table_rows, dtype=torch.int64)
        bad = (sparse < 0) | (sparse >= rows)
        if bool(bad.any()):
            sample, table = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"id {int(sparse[sample, table])} of table {table} (sample {sample}) is "
                f"outside its {self.table_rows[table]} rows"
            )
        tables = torch.arange(self.num_tables)
        owners = ((sparse + 1) * self.num_shards - 1) // rows
        local = self._offsets[owners, tables] + sparse - self._bounds[tables, owners]
        return owners, local

    def _locate_table(self, table: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        if (
            isinstance(table, bool)
            or not isinstance(table, int)
            or not 0 <= table < self.num_tables
        ):
            raise ValueError(f"table must be in 0..{self.num_tables - 1}, got {table!r}")
        column = torch.zeros(rows.numel(), self.num_tables, dtype=torch.int64)
        column[:, table] = rows.reshape(-1)
        try:
            owners, local = self.locate(column)
        except ValueError as err:
            raise ValueError(f"table {table}: {err}") from None
        return owners[:, table].view_as(rows), local[:, table].view_as(rows)

    def global_rows(self, shard: int) -> tuple[Tensor, Tensor]:
        """``(table, row)`` of each local row of ``shard``, as two int64 tensors."""
        tables, rows = [], []
        for t, (start, stop) in enumerate(self.shard_rows(shard)):
            tables.append(torch.full((stop - start,), t, dtype=torch.int64))
            rows.append(torch.arange(start, stop, dtype=torch.int64))
        return torch.cat(tables), torch.cat(rows)

    def _check_shard(self, shard: int) -> None:
        if (
            isinstance(shard, bool)
            or not isinstance(shard, int)
            or not 0 <= shard < self.num_shards
        ):
            raise ValueError(f"shard must be in 0..{self.num_shards - 1}, got {shard!r}")


# ---- the modules -----------------------------------------------------------------------


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


class EmbeddingShard(nn.Module):
    """The embedding rows one worker owns, all tables in one flat ``weight``.

    ``weight`` is ``[layout.shard_size(shard), dim]``; ``accumulator`` (a buffer, one
    float per row) is the row-wise Adagrad state. Both are the shard's whole state.
    """

    def __init__(self, layout: ShardLayout, shard: int, dim: int, *, seed: int) -> None:
        super().__init__()
        self.layout = layout
        self.shard = shard
        parts = [
            init_table_rows(seed, t, layout.table_rows[t], start, stop, dim)
            for t, (start, stop) in enumerate(layout.shard_rows(shard))
        ]
        self.weight = nn.Parameter(torch.cat(parts), requires_grad=False)
        self.accumulator: Tensor
        self.register_buffer("accumulator", torch.zeros(self.weight.shape[0]))

    @property
    def num_rows(self) -> int:
        return int(self.weight.shape[0])

    def load(self, weight: Tensor, accumulator: Tensor) -> None:
        """Replace the shard's rows and optimizer state (copies).

        Raises:
            ValueError: if a shape or dtype differs from this shard's, before anything is
                written.
        """
        if weight.shape != self.weight.shape or weight.dtype != self.weight.dtype:
            raise ValueError(
                f"shard {self.shard} weight is {tuple(self.weight.shape)} {self.weight.dtype}; "
                f"got {tuple(weight.shape)} {weight.dtype}"
            )
        if accumulator.shape != self.accumulator.shape or accumulator.dtype != torch.float32:
            raise ValueError(
                f"shard {self.shard} accumulator is {tuple(self.accumulator.shape)} float32; "
                f"got {tuple(accumulator.shape)} {accumulator.dtype}"
            )
        with torch.no_grad():
            self.weight.copy_(weight)
            self.accumulator.copy_(accumulator)


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


# ---- collectives -----------------------------------------------------------------------


class Collective(Protocol):
    """What the embedding exchange needs from the workers' communication.

    Every worker of the group calls each method in the same order (a collective).
    """

    rank: int
    world_size: int

    def all_to_all(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Send ``tensors[d]`` to rank ``d``; return what each rank ``s`` sent here.

        The tensors may differ in dim 0 but share dtype and trailing dims across ranks.
        The returned tensors are this worker's own (they may be modified).
        """
        ...

    def all_reduce_sum(self, tensor: Tensor) -> None:
        """Replace ``tensor`` with the sum over ranks; every rank gets identical values."""
        ...


class LocalGroup:
    """``world_size`` workers that are threads of this process, meeting at a barrier.

    ``collective(rank)`` is rank ``rank``'s `Collective`. Every wait is bounded by
    ``timeout``; if one worker fails, `abort` wakes the others with
    ``threading.BrokenBarrierError`` instead of leaving them blocked.
    """

    def __init__(self, world_size: int, *, timeout: datetime.timedelta) -> None:
        _positive_int("world_size", world_size)
        self.world_size = world_size
        self._timeout = timeout.total_seconds()
        self._barrier = threading.Barrier(world_size, timeout=self._timeout)
        self._slots: list[Any] = [None] * world_size

    def collective(self, rank: int) -> _LocalCollective:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        return _LocalCollective(self, rank)

    def abort(self) -> None:
        """Wake every waiting worker with ``BrokenBarrierError``."""
        self._barrier.abort()

    def reset(self) -> None:
        """Make the group usable again after `abort` (call when no worker is waiting)."""
        self._barrier.reset()
        self._slots = [None] * self.world_size

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        seen = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return seen


class _LocalCollective:
    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_to_all(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        if len(tensors) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} tensors, got {len(tensors)}")
        seen = self.group._exchange(self.rank, [t.detach() for t in tensors])
        return [sent[self.rank].clone() for sent in seen]

    def all_reduce_sum(self, tensor: Tensor) -> None:
        seen = self.group._exchange(self.rank, tensor.detach().clone())
        total = seen[0].clone()
        for part in seen[1:]:  # the same order on every rank: identical sums
            total += part
        tensor.copy_(total)


class ProcessGroupCollective:
    """A `Collective` over a ``torch.distributed`` process group object.

    ``group`` is a backend process group (``ProcessGroupGloo`` or ``ProcessGroupNCCL``)
    used directly, as `parallelism.comm.StageComm` builds them: ``alltoall_base`` for the
    exchange (sizes first, then the data) and ``allreduce`` for the sums. Every wait is
    bounded by ``timeout``; a dead peer surfaces as the backend's ``RuntimeError``.
    """

    def __init__(self, group: Any, *, timeout: datetime.timedelta) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.world_size = int(group.size())
        self.timeout = timeout

    def all_to_all(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        w = self.world_size
        if len(tensors) != w:
            raise ValueError(f"all_to_all needs {w} tensors, got {len(tensors)}")
        trailing = tuple(tensors[0].shape[1:])
        if any(tuple(t.shape[1:]) != trailing or t.dtype != tensors[0].dtype for t in tensors):
            raise ValueError("all_to_all tensors must share dtype and trailing dims")
        device = tensors[0].device
        send_counts = torch.tensor([int(t.shape[0]) for t in tensors], dtype=torch.int64)
        recv_counts = torch.empty(w, dtype=torch.int64, device=device)
        opts = dist.AllToAllOptions()
        self._wait(
            self.group.alltoall_base(recv_counts, send_counts.to(device), [1] * w, [1] * w, opts)
        )
        splits_in = [int(c) for c in recv_counts.cpu()]
        send = torch.cat([t.detach().contiguous() for t in tensors])
        recv = torch.empty((sum(splits_in), *trailing), dtype=send.dtype, device=device)
        self._wait(self.group.alltoall_base(recv, send, splits_in, send_counts.tolist(), opts))
        return list(recv.split(splits_in))

    def all_reduce_sum(self, tensor: Tensor) -> None:
        self._wait(self.group.allreduce([tensor]))

    def _wait(self, work: Any) -> None:
        work.wait(self.timeout)


# ---- the exchange ----------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """Where a worker's ids go. See [Note: embedding exchange]."""

    requests: tuple[Tensor, ...]
    """Per owner ``d``: ``[n_d, 2]`` int64, unique local rows (ascending) and lookups each."""
    inverse: Tensor
    """``[B * T]``: each lookup's position in the owners' answers, concatenated in order."""
    batch: int
    tables: int

    @property
    def splits(self) -> list[int]:
        return [int(r.shape[0]) for r in self.requests]


def route_lookups(layout: ShardLayout, sparse: Tensor) -> Routing:
    """Route a batch's ids ``[B, T]`` to their owners (pure; no communication).

    Raises:
        ValueError: if ``sparse`` is not ``[B, T]`` int64 with ``T`` tables of the layout,
            or an id is outside its table (naming the table and the id).
    """
    owners, local = layout.locate(sparse)
    stride = layout._stride  # > every local index: keys sort by owner, then local row
    keys, inverse, counts = torch.unique(
        (owners * stride + local).reshape(-1), sorted=True, return_inverse=True, return_counts=True
    )
    key_owner = keys // stride
    per_owner = torch.bincount(key_owner, minlength=layout.num_shards).tolist()
    table = torch.stack([keys % stride, counts], dim=1)
    return Routing(
        requests=tuple(table.split(per_owner)),
        inverse=inverse,
        batch=int(sparse.shape[0]),
        tables=layout.num_tables,
    )


@dataclass(frozen=True)
class StepUpdate:
    """What one step changed in one shard: the rows it updated and their lookup counts."""

    rows: Tensor
    """Unique local rows of the shard (ascending), int64."""
    lookups: Tensor
    """Lookups of each row in this step's global batch (samples x features hitting it)."""


@dataclass
class _Pending:
    rows: Tensor
    grads: Tensor
    lookups: Tensor


def _owner_gradients(incoming: Sequence[Tensor], grads: Sequence[Tensor]) -> _Pending:
    """Sum the gradients each source sent for its requested rows, per unique local row."""
    requested = torch.cat(list(incoming))
    rows, inverse = torch.unique(requested[:, 0], sorted=True, return_inverse=True)
    dim = grads[0].shape[1]
    summed = torch.zeros(rows.shape[0], dim, dtype=grads[0].dtype)
    summed.index_add_(0, inverse, torch.cat(list(grads)))
    lookups = torch.zeros(rows.shape[0], dtype=torch.int64)
    lookups.index_add_(0, inverse, requested[:, 1])
    return _Pending(rows=rows, grads=summed, lookups=lookups)


# ---- one worker ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepLoss:
    """What one worker measured in phase one of a step."""

    loss_sum: float
    samples: int


class DLRMWorker:
    """One worker of a sharded DLRM: its embedding shard and its dense replica.

    A step has two phases (as `recovery.worker.StageWorker`'s): `run_step` does every
    exchange and the dense all-reduce but applies nothing; `commit` applies the row-wise
    Adagrad update to this shard's touched rows and Adam to the dense replica; `abandon`
    drops a step that failed somewhere. Every worker's batch must have the same size.

    Args:
        config: the model.
        layout: the row sharding; ``rank`` is this worker's shard.
        seed: seeds the initial weights (equal to `DLRM`'s with the same seed).
        sparse_lr, eps: row-wise Adagrad of the embedding rows.
        dense_lr: Adam of the dense part.
    """

    def __init__(
        self,
        config: DLRMConfig,
        layout: ShardLayout,
        rank: int,
        *,
        seed: int = 0,
        sparse_lr: float = 0.05,
        dense_lr: float = 1e-3,
        eps: float = 1e-8,
    ) -> None:
        if layout.table_rows != config.table_rows:
            raise ValueError(
                f"layout tables {layout.table_rows} differ from the model's {config.table_rows}"
            )
        self.config = config
        self.layout = layout
        self.rank = rank
        self.shard = EmbeddingShard(layout, rank, config.embedding_dim, seed=seed)
        self.dense = _build_dense(config, seed)
        self.dense_optimizer = _dense_optimizer(self.dense, dense_lr)
        self.sparse_lr = sparse_lr
        self.eps = eps
        self._pending: _Pending | None = None

    def run_step(
        self, coll: Collective, batch: ClickBatch, hook: Callable[[str], None] | None = None
    ) -> StepLoss:
        """Phase one: exchange, forward, backward, gradient exchange and all-reduce.

        ``hook`` is called with ``"mid_pipeline"`` after the lookup exchange and with
        ``"during_allreduce"`` between the gradient exchange and the dense all-reduce (the
        points where the runtime injects failures).

        Raises:
            ValueError: for a batch that does not fit the model, or a collective of another
                rank or size (before any exchange).
            RuntimeError: if a step is already pending, or a collective fails.
        """
        if self._pending is not None:
            raise RuntimeError(f"worker {self.rank} has an uncommitted step; commit or abandon")
        if (coll.rank, coll.world_size) != (self.rank, self.layout.num_shards):
            raise ValueError(
                f"worker {self.rank} of {self.layout.num_shards} shards was given the collective "
                f"of rank {coll.rank} of {coll.world_size}"
            )
        if batch.dense.shape[1] != self.config.dense_features:
            raise ValueError(
                f"batch has {batch.dense.shape[1]} dense features, the model "
                f"{self.config.dense_features}"
            )
        hook = hook or (lambda point: None)
        routing = route_lookups(self.layout, batch.sparse)
        embeddings, incoming, received = self._lookup(coll, routing)
        hook("mid_pipeline")
        self.dense.zero_grad(set_to_none=False)
        logits = self.dense(batch.dense, embeddings)
        loss_sum = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        (loss_sum / (coll.world_size * routing.batch)).backward()
        assert received.grad is not None
        grads = coll.all_to_all(list(received.grad.split(routing.splits)))
        pending = _owner_gradients(incoming, grads)
        flat = torch.cat([_grad(p).reshape(-1) for p in self.dense.parameters()])
        hook("during_allreduce")
        coll.all_reduce_sum(flat)
        offset = 0
        for p in self.dense.parameters():
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        self._pending = pending
        return StepLoss(loss_sum=float(loss_sum.detach()), samples=routing.batch)

    @property
    def pending(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The uncommitted step's ``(rows, summed gradients, lookups)`` of this shard (rows
        unique, ascending), or None."""
        p = self._pending
        return None if p is None else (p.rows, p.grads, p.lookups)

    def commit(self) -> StepUpdate:
        """Phase two: apply the pending step. Returns the rows it updated in this shard.

        Raises:
            RuntimeError: if no step is pending.
        """
        if self._pending is None:
            raise RuntimeError(f"worker {self.rank} has no step to commit")
        p, self._pending = self._pending, None
        rowwise_adagrad_(
            self.shard.weight,
            self.shard.accumulator,
            p.rows,
            p.grads,
            lr=self.sparse_lr,
            eps=self.eps,
        )
        self.dense_optimizer.step()
        self.dense.zero_grad(set_to_none=True)
        return StepUpdate(rows=p.rows, lookups=p.lookups)

    def abandon(self) -> None:
        """Drop a pending step (it failed somewhere): nothing of it is applied."""
        self._pending = None
        self.dense.zero_grad(set_to_none=True)

    def predict(self, coll: Collective, batch: ClickBatch) -> Tensor:
        """Logits of a batch (forward only; still a collective: every worker calls it)."""
        routing = route_lookups(self.layout, batch.sparse)
        with torch.no_grad():
            embeddings, _, _ = self._lookup(coll, routing)
            return self.dense(batch.dense, embeddings)

    def _lookup(self, coll: Collective, routing: Routing) -> tuple[Tensor, list[Tensor], Tensor]:
        incoming = coll.all_to_all(list(routing.requests))
        weight = self.shard.weight.detach()
        answers = coll.all_to_all([weight[req[:, 0]] for req in incoming])
        received = torch.cat(answers).requires_grad_()
        embeddings = received[routing.inverse].view(
            routing.batch, routing.tables, self.config.embedding_dim
        )
        return embeddings, incoming, received

    # -- state (what recovery moves) ----------------------------------------------------

    def dense_state(self) -> dict[str, Any]:
        """A copy of the dense replica's weights and Adam state."""
        return copy.deepcopy(
            {"model": self.dense.state_dict(), "optimizer": self.dense_optimizer.state_dict()}
        )

    def load_dense(self, state: dict[str, Any]) -> None:
        """Replace the dense replica with ``state`` (from `dense_state` of a live replica).

        Raises:
            RuntimeError: if the state does not match this model, before anything changes.
        """
        missing = set(self.dense.state_dict()) ^ set(state.get("model", {}))
        if missing:
            raise RuntimeError(f"dense state does not match this model: keys {sorted(missing)}")
        for key, value in self.dense.state_dict().items():
            if state["model"][key].shape != value.shape:
                raise RuntimeError(
                    f"dense state {key} is {tuple(state['model'][key].shape)}, "
                    f"expected {tuple(value.shape)}"
                )
        self.dense.load_state_dict(copy.deepcopy(state["model"]))
        self.dense_optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self._pending = None


def dlrm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean binary cross-entropy of click logits against labels."""
    return F.binary_cross_entropy_with_logits(logits, labels)


def _grad(p: nn.Parameter) -> Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


@dataclass(frozen=True)
class DLRMTraining:
    """How the runtime trains a DLRM (`recovery.spec.TrainSpec.dlrm`): the model and the
    learning rates of its two optimizers.

    Raises:
        ValueError: for a non-positive learning rate or epsilon.
    """

    config: DLRMConfig
    sparse_lr: float = 0.05
    """Row-wise Adagrad of the embedding rows."""
    dense_lr: float = 1e-3
    """Adam of the dense part."""
    eps: float = 1e-8

    def __post_init__(self) -> None:
        for name in ("sparse_lr", "dense_lr", "eps"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"DLRMTraining.{name} must be a positive number, got {value!r}")

    def worker(self, rank: int, world_size: int, *, seed: int) -> DLRMWorker:
        """Worker ``rank`` of ``world_size`` at the initial state.

        Raises:
            ValueError: if the tables cannot be split into ``world_size`` shards.
        """
        return DLRMWorker(
            self.config,
            ShardLayout(self.config.table_rows, world_size),
            rank,
            seed=seed,
            sparse_lr=self.sparse_lr,
            dense_lr=self.dense_lr,
            eps=self.eps,
        )


# ---- the unsharded reference -----------------------------------------------------------


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


# ---- W workers in one process ----------------------------------------------------------


class InProcessDLRM:
    """``workers`` sharded DLRM workers run as threads of this process (tests, experiments).

    Each worker runs exactly the code it runs under the Ray runtime, over a `LocalGroup`.
    ``batches(step, replica, num_replicas)`` gives each worker its batch (e.g. a
    `parallelism.clicks.ClickLogs`).

    Raises:
        ValueError: if the tables cannot be split over ``workers`` shards.
    """

    def __init__(
        self,
        config: DLRMConfig,
        *,
        workers: int,
        batches: Callable[[int, int, int], ClickBatch],
        seed: int = 0,
        sparse_lr: float = 0.05,
        dense_lr: float = 1e-3,
        timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    ) -> None:
        self.config = config
        self.layout = ShardLayout(config.table_rows, workers)
        self.batches = batches
        self.seed = seed
        self._opt = {"sparse_lr": sparse_lr, "dense_lr": dense_lr}
        self.workers = [self.new_worker(rank) for rank in range(workers)]
        self.group = LocalGroup(workers, timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dlrm-worker")
        self._timeout = timeout.total_seconds()

    @property
    def world_size(self) -> int:
        return self.layout.num_shards

    def new_worker(self, rank: int) -> DLRMWorker:
        """A worker for ``rank`` at the initial state (what a replacement starts from)."""
        return DLRMWorker(self.config, self.layout, rank, seed=self.seed, **self._opt)

    def _spmd(self, fn: Callable[[DLRMWorker, Collective], Any]) -> list[Any]:
        def run(rank: int) -> Any:
            try:
                return fn(self.workers[rank], self.group.collective(rank))
            except BaseException:
                self.group.abort()
                raise

        futures = [self._pool.submit(run, rank) for rank in range(self.world_size)]
        results: list[Any] = []
        errors: list[BaseException] = []
        for future in futures:
            try:
                results.append(future.result(timeout=self._timeout))
            except BaseException as exc:
                errors.append(exc)
        if errors:
            self.group.reset()
            # The first real error, not the broken barriers it caused in the other workers.
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results

    def run_step(self, step: int) -> float:
        """Phase one of ``step`` on every worker; returns the global mean loss."""
        w = self.world_size
        stats = self._spmd(
            lambda worker, coll: worker.run_step(coll, self.batches(step, worker.rank, w))
        )
        return sum(s.loss_sum for s in stats) / sum(s.samples for s in stats)

    def commit(self) -> list[StepUpdate]:
        """Phase two on every worker; returns each shard's `StepUpdate`, by rank."""
        return [worker.commit() for worker in self.workers]

    def abandon(self) -> None:
        for worker in self.workers:
            worker.abandon()

    def train_step(self, step: int) -> tuple[float, list[StepUpdate]]:
        """Both phases of ``step``."""
        loss = self.run_step(step)
        return loss, self.commit()

    def tables(self) -> list[Tensor]:
        """The full tables, assembled from the shards (copies)."""
        return assemble_tables(self.layout, [w.shard.weight.detach() for w in self.workers])

    def predict(self, batch: ClickBatch, *, chunk: int = 8192) -> Tensor:
        """Logits of ``batch`` from the full tables and worker 0's dense replica."""
        return predict_unsharded(self.workers[0].dense, self.tables(), batch, chunk=chunk)

    def evaluate(self, batch: ClickBatch) -> tuple[float, float]:
        """``(AUC, log loss)`` on a held-out batch."""
        logits = self.predict(batch)
        return roc_auc(logits, batch.labels), log_loss(logits, batch.labels)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def assemble_tables(layout: ShardLayout, shards: Sequence[Tensor]) -> list[Tensor]:
    """The full tables from every shard's ``weight`` (in shard order), as copies.

    Raises:
        ValueError: if the number or shapes of the shards do not match the layout.
    """
    if len(shards) != layout.num_shards:
        raise ValueError(f"{len(shards)} shards given, the layout has {layout.num_shards}")
    for shard, weight in enumerate(shards):
        if weight.dim() != 2 or weight.shape[0] != layout.shard_size(shard):
            raise ValueError(
                f"shard {shard} is {tuple(weight.shape)}, expected {layout.shard_size(shard)} rows"
            )
    out = []
    for t in range(layout.num_tables):
        parts = []
        for shard, weight in enumerate(shards):
            start, stop = layout.shard_rows(shard)[t]
            offset = layout.offsets(shard)[t]
            parts.append(weight[offset : offset + stop - start])
        out.append(torch.cat(parts))
    return out


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
