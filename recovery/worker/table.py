"""The worker of a model with row-sharded embedding tables (`dlrm_spec`), as a Ray actor.

`TableWorker` is a `recovery.worker.StageWorker` whose "stage" is one shard of every
embedding table plus a replica of the dense part (`parallelism.dlrm.DLRMWorker`); the
job's topology is one stage by ``W`` replicas. It keeps the two-phase step, the peer and
durable snapshots, and the failure handling of its base class, and adds the shard mirror.

[Note: shard mirrors at runtime]
Every worker mirrors the shard of its ward -- the worker before it on the snapshot ring
(`recovery.snapshots.buddies`, which puts neighbours on different nodes where it can) --
in a `recovery.strategies.embedding.ShardCopy`. In phase one of a step, once the row
gradients are exchanged, the owner computes the `MirrorUpdate` its commit will imply
(`mirror_update_before_commit`: the updated rows and their lookups, and the post-commit
values of the hot rows, or of every row every ``mirrors.every`` steps) and sends it to its
holder; the holder keeps it pending and applies it only when the step commits, so the
commit stays local and an abandoned step leaves every mirror as it was. After every
membership change each owner re-seeds its holder with a full copy (`seed_mirror`).

When a worker dies, its holder rebuilds the shard from the mirror (`restore_shard`):
rows whose copy is current come back exact, the others stale, with the lookups whose
updates were lost (the PLS, see recovery/strategies/embedding.py). The holder also holds
a replica of the dense part, so one transfer gives the replacement everything; survivors
do not roll back. The planner decides from the holders' assessment (`assess_mirror`)
whether that is allowed (``RecoveryPolicy.mirrors``: ``embedding``, ``pls_budget``).

The tables train on the CPU over Gloo; a GPU job keeps them there too (not tested on GPUs).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from parallelism.comm import ReceiveBudget, Rendezvous, StageComm, empty_received
from parallelism.engine import StepStats
from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from parallelism.workloads.clicks import ClickBatch
from parallelism.workloads.dlrm import ProcessGroupCollective
from recovery.errors import TransferCorrupted
from recovery.faults import Fault, KillPoint
from recovery.state import WorkerState
from recovery.strategies.embedding import (
    MFUTracker,
    MirrorPlan,
    MirrorUpdate,
    ShardCopy,
    mirror_update_before_commit,
    restore_shard,
)
from recovery.transport import ProcessGroupTransport
from recovery.worker.callbacks import guard_callbacks
from recovery.worker.reports import StepReport
from recovery.worker.stage import StageWorker


class TableModule(nn.Module):
    """A worker's whole model state in one module: its shard (rows and row-wise optimizer
    state) and its dense replica -- what snapshots and checkpoints save."""

    def __init__(self, shard: nn.Module, dense: nn.Module) -> None:
        super().__init__()
        self.shard = shard
        self.dense = dense


class _StageCollective(ProcessGroupCollective):
    """The embedding exchange over a generation's world group, its waits visible to the
    controller's hang detection (``StageComm.waiting_on``)."""

    def __init__(self, comm: StageComm, timeout: datetime.timedelta) -> None:
        super().__init__(comm.world, timeout=timeout)
        self.comm = comm

    def _wait(self, work: Any) -> None:
        self.comm.wait(work, -1)


class TableWorker(StageWorker):
    """One shard of every embedding table and one dense replica. See [Note: shard mirrors
    at runtime]."""

    def setup(
        self,
        spec: TrainSpec,
        topology: Topology,
        rank: int,
        backend: str,
        device: str | None = None,
        mirror: MirrorPlan | None = None,
    ) -> float:
        """Build the shard and dense replica at their initial state. Returns seconds taken.

        Raises:
            ValueError: if the spec has no tables, or the backend is not Gloo, or the
                device is not the CPU.
        """
        start = time.perf_counter()
        if spec.tables is None:
            raise ValueError("TableWorker needs a TrainSpec with tables (dlrm_spec)")
        if backend != "gloo":
            raise ValueError(
                f"sharded embedding tables train on the CPU over Gloo, not {backend!r}"
            )
        if device not in (None, "cpu"):
            raise ValueError(f"sharded embedding tables train on the CPU, not on {device!r}")
        self.topology = topology
        self.rank = rank
        coords = topology.worker(rank)
        self.stage, self.replica = coords.stage, coords.replica
        self.spec = spec = guard_callbacks(spec, self)
        self.backend = backend
        self.device = torch.device("cpu")
        assert spec.tables is not None
        self.table = spec.tables.worker(rank, topology.replicas, seed=spec.seed)
        self.module = TableModule(self.table.shard, self.table.dense)
        self.optimizer = self.table.dense_optimizer
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.shared_names: list[str] = []
        self.zero = None
        self.tracker = MFUTracker(self.table.shard.num_rows)
        self.plan = mirror or MirrorPlan()
        self.mirror: ShardCopy | None = None
        self._hot: torch.Tensor | None = None
        """The hot rows the last mirror update carried (see `MirrorPlan.hot_every`)."""
        self._incoming: MirrorUpdate | None = None
        self.coll: _StageCollective | None = None
        self.mirror_sent = 0
        """Bytes of mirror updates sent (phase one of every step), seeds excluded."""
        self.mirror_steps = 0
        self._start_fresh()
        return time.perf_counter() - start

    def _reshard_rows(self) -> list[tuple[int, int]] | None:
        """This shard's rows of each table: a reshard gathers them by row range."""
        return list(self.table.shard.layout.shard_rows(self.table.shard.shard))

    def join(
        self,
        generation: int,
        rendezvous: Rendezvous,
        bind_host: str,
        side_group: bool = False,
        buddy: int | None = None,
        ward: int | None = None,
        members: tuple[int, ...] | None = None,
        shares: tuple[int, ...] | None = None,
    ) -> float:
        if members is not None or shares is not None:  # the layout refuses elastic=True
            raise ValueError("sharded embedding tables cannot train in a shrunk generation")
        seconds = super().join(generation, rendezvous, bind_host, side_group, buddy, ward)
        assert self.comm is not None
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        self.coll = _StageCollective(self.comm, timeout)
        return seconds

    def reset(self, release: bool = True) -> None:
        for name in ("table", "mirror", "coll", "tracker"):
            self.__dict__.pop(name, None)
        super().reset(release)

    # -- the two phases ------------------------------------------------------------------

    def run_step(
        self,
        step: int,
        faults: tuple[Fault, ...] = (),
        fingerprint: bool = False,
        decide: bool = False,
    ) -> StepReport:
        """Phase one: lookups, forward, backward, row-gradient exchange, dense all-reduce,
        and the mirror updates this step will imply. Applies nothing unless ``decide``
        (see [Note: workers decide the commit] in recovery/worker/stage.py). (No
        fingerprint: the replicas of a table stage hold different shards, so there is
        nothing to vote on.)"""
        if decide and step > self.step:
            return self._skipped(step)
        self._begin_step(step, faults)
        assert self.spec is not None
        batch = cast(ClickBatch, self.spec.batches(step, self.replica, self.topology.replicas))
        start = time.perf_counter()
        try:
            self._hook(KillPoint.BEFORE_FORWARD.value)
            loss = self.table.run_step(self.coll, batch, self._hook)  # type: ignore[arg-type]
            self._exchange_updates(step)
        except Exception as exc:
            return self._failed(step, exc)
        finally:
            self._activity = ("idle", time.time())
        grads = [p.grad.reshape(-1) for p in self.table.dense.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.cat(grads))) if grads else 0.0
        elapsed = time.perf_counter() - start
        stats = StepStats(
            loss_sum=loss.loss_sum / loss.samples,
            losses=1,
            grad_norm=norm,
            clipped_grad_norm=norm,
            compute_s=elapsed,
            schedule_s=elapsed,
        )
        report = self._report(step, stats)
        return self._decided(step, report) if decide else report

    def _apply(self, step: int) -> None:
        """The commit's work: apply the step to the shard and the dense replica, and the
        ward's pending mirror update to the mirror."""
        update = self.table.commit()
        self.tracker.observe(update.rows, update.lookups)
        if self._incoming is not None and self.mirror is not None:
            self.mirror.apply(self._incoming)
        self._incoming = None

    def _drop_step(self) -> None:
        super()._drop_step()
        if "table" in self.__dict__:
            self.table.abandon()
        self._incoming = None

    def evaluate(self, index: int) -> StepReport:
        """Held-out log loss of this worker's part of validation batch ``index``."""
        assert self.spec is not None and self.spec.val_batches is not None
        batch = cast(ClickBatch, self.spec.val_batches(index, self.replica, self.topology.replicas))
        try:
            logits = self.table.predict(self.coll, batch)  # type: ignore[arg-type]
        except Exception as exc:
            return self._failed(self.step, exc)
        loss = float(F.binary_cross_entropy_with_logits(logits, batch.labels))
        return StepReport(
            rank=self.rank, step=self.step, ok=True, stats=StepStats(loss_sum=loss, losses=1)
        )

    def warm(
        self, spec: TrainSpec, topology: Topology, backend: str, device: str | None = None
    ) -> float:
        """A hot spare's one-time costs: build a shard and a dense replica, and run the
        dense part forward and backward once."""
        start = time.perf_counter()
        self.setup(spec, topology, 0, backend, device)
        batch = cast(ClickBatch, spec.batches(0, 0, topology.replicas))
        config = self.table.config
        embeddings = torch.zeros(len(batch), config.num_tables, config.embedding_dim)
        self.table.dense(batch.dense, embeddings).sum().backward()
        self.optimizer.step()
        self.reset()
        return time.perf_counter() - start

    # -- the mirror ----------------------------------------------------------------------

    def _exchange_updates(self, step: int) -> None:
        """Send the holder this step's `MirrorUpdate`; receive the ward's (kept pending)."""
        if self.buddy is None or self.ward is None or self.buddy == self.rank:
            return
        assert self.comm is not None
        pending = self.table.pending
        assert pending is not None
        rows, grads, lookups = pending
        shard = self.table.shard
        update = mirror_update_before_commit(
            self.plan,
            shard=self.rank,
            committed=step + 1,
            weight=shard.weight,
            accumulator=shard.accumulator,
            counts=self.tracker.counts,
            rows=rows,
            grads=grads,
            lookups=lookups,
            lr=self.table.sparse_lr,
            eps=self.table.eps,
            hot=self._hot,
        )
        if not update.full:
            self._hot = update.rows
        header = torch.tensor([update.shard, update.committed, int(update.full)])
        parts = (update.updated, update.lookups, update.rows, update.weight, update.accumulator)
        self.comm.isend(header, self.buddy)
        for t in parts:
            self._isend_sized(t, self.buddy)
        theirs = self.comm.recv(torch.empty(3, dtype=torch.int64), self.ward)
        budget = ReceiveBudget(torch.device("cpu"))  # one for the whole update
        updated, counts, sent_rows = (
            self._recv_sized(self.ward, torch.int64, budget) for _ in range(3)
        )
        dim = self.table.config.embedding_dim
        values = self._recv_sized(self.ward, shard.weight.dtype, budget).view(-1, dim)
        state = self._recv_sized(self.ward, torch.float32, budget)
        self.comm.wait_sends()
        self._incoming = MirrorUpdate(
            shard=int(theirs[0]),
            committed=int(theirs[1]),
            updated=updated,
            lookups=counts,
            rows=sent_rows,
            weight=values,
            accumulator=state,
            full=bool(theirs[2]),
        )
        self.mirror_sent += update.nbytes
        self.mirror_steps += 1

    def _isend_sized(self, tensor: torch.Tensor, dst: int) -> None:
        """A 1-D view of ``tensor``, preceded by its length (nothing more when empty)."""
        flat = tensor.detach().reshape(-1)
        assert self.comm is not None
        self.comm.isend(torch.tensor([flat.numel()]), dst)
        if flat.numel():
            self.comm.isend(flat, dst)

    def _recv_sized(self, src: int, dtype: torch.dtype, budget: ReceiveBudget) -> torch.Tensor:
        """What `_isend_sized` sent: its length, checked and drawn on ``budget``, then it.

        Raises:
            GarbledMessage: for a length out of bounds or over the budget.
        """
        assert self.comm is not None
        n = int(self.comm.recv(torch.empty(1, dtype=torch.int64), src))
        out = empty_received((n,), dtype, budget.device, f"a mirror update from rank {src}", budget)
        return self.comm.recv(out, src) if n else out

    def seed_mirror(self, send: bool = True, receive: bool = True) -> int:
        """Send the holder a full copy of this shard (``send``); take one of the ward's
        (``receive``). Returns bytes sent."""
        if self.buddy is None or self.ward is None or self.buddy == self.rank:
            self.mirror = None
            return 0
        assert self.comm is not None
        shard = self.table.shard
        mine = (shard.weight.detach(), shard.accumulator, self.tracker.counts)
        if send:
            self.comm.isend(torch.tensor([self.step]), self.buddy)
            for t in mine:
                self.comm.isend(t, self.buddy)
        if receive:
            rows = self.table.layout.shard_size(self.ward)
            step = int(self.comm.recv(torch.empty(1, dtype=torch.int64), self.ward))
            weight = self.comm.recv(torch.empty(rows, shard.weight.shape[1]), self.ward)
            accumulator = self.comm.recv(torch.empty(rows), self.ward)
            counts = self.comm.recv(torch.empty(rows, dtype=torch.int64), self.ward)
            self.mirror = ShardCopy.take(
                self.ward, weight, accumulator, committed=step, lookups=counts
            )
        self.comm.wait_sends()
        return sum(t.numel() * t.element_size() for t in mine) if send else 0

    def assess_mirror(self, ward: int) -> dict[str, int]:
        """What restoring ``ward``'s shard from this worker's mirror would give (nothing is
        changed): rows exact and stale, and the lookups whose updates would be lost.

        Raises:
            RuntimeError: if this worker does not mirror ``ward``.
        """
        if self.mirror is None or self.mirror.shard != ward:
            held = None if self.mirror is None else self.mirror.shard
            raise RuntimeError(f"worker {self.rank} mirrors shard {held}, not {ward}")
        restored = restore_shard([self.mirror])
        return {
            "rows_exact": restored.rows_exact,
            "rows_stale": restored.rows_stale,
            "lost_lookups": restored.lost_lookups,
        }

    def mirror_costs(self) -> dict[str, float]:
        """The mirror's memory here and the update traffic this worker sent, per step."""
        memory = self.mirror.nbytes if self.mirror is not None else 0
        per_step = self.mirror_sent / self.mirror_steps if self.mirror_steps else 0.0
        shard = self.table.shard
        shard_bytes = shard.weight.numel() * shard.weight.element_size()
        shard_bytes += shard.accumulator.numel() * shard.accumulator.element_size()
        return {
            "mirror_memory_bytes": float(memory),
            "shard_bytes": float(shard_bytes),
            "update_bytes_per_step": per_step,
        }

    def send_mirror(self, dst: int) -> int:
        """Send ``dst`` (the ward's replacement) the ward's shard restored from the mirror,
        and this worker's dense replica and step. Returns bytes sent."""
        assert self.comm is not None and self.mirror is not None
        restored = restore_shard([self.mirror])
        self.mirror.rebase(restored)  # the replacement holds what the mirror holds now
        dense = WorkerState(self.table.dense, self.optimizer, self.progress)
        sent = ProcessGroupTransport(self.comm).send(dst, dense, wait=False)
        for t in (restored.weight, restored.accumulator, restored.lookups):
            self.comm.isend(t, dst)
            sent += t.numel() * t.element_size()
        self.comm.wait_sends()
        return sent

    def recv_shard(self, src: int) -> tuple[int, int, dict[int, list[str]]]:
        """Take the dense replica, step and this shard (restored from the holder's mirror).
        Returns ``(step, bytes received, what arrived corrupted)``: the dense replica is
        checked against the sender's digests (the shard's rows are not)."""
        assert self.comm is not None
        corrupted: dict[int, list[str]] = {}
        try:
            dense = WorkerState(self.table.dense, self.optimizer, self.progress)
            self.progress, received = self._transport().recv(src, dense)
        except TransferCorrupted as exc:  # receive the rest all the same: the protocol goes on
            corrupted = {source: list(tensors) for _, source, tensors in exc.found}
            received = 0
        shard = self.table.shard
        weight = self.comm.recv(torch.empty_like(shard.weight.detach()), src)
        accumulator = self.comm.recv(torch.empty_like(shard.accumulator), src)
        counts = self.comm.recv(torch.empty(shard.num_rows, dtype=torch.int64), src)
        shard.load(weight, accumulator)
        self.tracker = MFUTracker(shard.num_rows, counts)
        received += sum(t.numel() * t.element_size() for t in (weight, accumulator, counts))
        return self.step, received, corrupted
