"""One worker of a row-sharded DLRM (`DLRMWorker`) and how it trains: a two-phase step over
a `Collective`, the runtime's recipe (`DLRMTraining`) and W workers in one process
(`InProcessDLRM`).

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
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallelism.checks import check_number
from parallelism.topology import Topology
from parallelism.workloads.clicks import ClickBatch
from parallelism.workloads.dlrm.collectives import Collective, LocalGroup
from parallelism.workloads.dlrm.model import (
    DLRMConfig,
    _build_dense,
    _dense_optimizer,
    log_loss,
    predict_unsharded,
    roc_auc,
    rowwise_adagrad_,
)
from parallelism.workloads.dlrm.sharding import EmbeddingShard, ShardLayout, assemble_tables

__all__ = [
    "DLRMTraining",
    "DLRMWorker",
    "InProcessDLRM",
    "Routing",
    "StepLoss",
    "StepUpdate",
    "route_lookups",
]


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


def _grad(p: nn.Parameter) -> Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


@dataclass(frozen=True)
class DLRMTraining:
    """How the runtime trains a DLRM (``TrainSpec.tables``, made by
    `parallelism.workloads.dlrm.spec.dlrm_spec`): the model and the learning rates of its
    two optimizers.

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
            check_number(f"DLRMTraining.{name}", getattr(self, name), positive=True)

    def check(
        self, topology: Topology, batch_fns: Sequence[Callable[[int, int, int], object] | None]
    ) -> int:
        """Validate a job of this model against ``topology`` on the driver, before any worker
        starts (`TrainSpec.check`); ``batch_fns``: its training and held-out batches.

        Returns the samples per step over all workers.

        Raises:
            ValueError: for more than one stage, tables too small to shard over the workers,
                or batches that are not `ClickBatch` es of the model's dense features.
        """
        if topology.stages != 1:
            raise ValueError(
                "a model with sharded embedding tables trains data-parallel with its tables "
                f"row-sharded over all workers: use 1 stage (--stages 1), got {topology.stages}"
            )
        ShardLayout(self.config.table_rows, topology.replicas)  # raises if too small
        sizes: set[int] = set()
        for fn in batch_fns:
            if fn is None:
                continue
            batch = fn(0, 0, topology.replicas)
            if not isinstance(batch, ClickBatch):
                raise ValueError(
                    f"batches() of a DLRM must return a ClickBatch, got {type(batch).__name__}"
                )
            if batch.dense.shape[1] != self.config.dense_features:
                raise ValueError(
                    f"batches have {batch.dense.shape[1]} dense features, the model "
                    f"{self.config.dense_features}"
                )
            sizes.add(len(batch))
        return min(sizes) * topology.replicas

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


class InProcessDLRM:
    """``workers`` sharded DLRM workers run as threads of this process (tests, experiments).

    Each worker runs exactly the code it runs under the Ray runtime, over a `LocalGroup`.
    ``batches(step, replica, num_replicas)`` gives each worker its batch (e.g. a
    `parallelism.workloads.clicks.ClickLogs`).

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
