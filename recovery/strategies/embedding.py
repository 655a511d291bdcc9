"""Partial recovery of row-sharded embedding tables: shard mirrors, restore, PLS, policy.

Pure functions and small state holders on tensors -- no processes, no communication -- so
the Ray runtime (on the states it gathers) and the in-process experiment
(`simulations.embedding`) run the same code. The pieces, in the order a job uses them:

- `MFUTracker`: the owner of a shard counts lookups per row (cheap: one ``index_add`` of
  the counts its step already has) and names the most frequently used rows.
- `MirrorPlan` and `mirror_update`: after committing a step, the owner of shard ``s``
  sends its ring successor ``(s + 1) % W`` a `MirrorUpdate`: the rows the step updated
  with their lookup counts (ints only), the hot rows' values every step, and all rows
  every ``mirror_every`` steps. `mirror_cost` and `MirrorUpdate.nbytes` account for the
  memory and traffic.
- `ShardCopy`: a copy of a shard kept elsewhere -- the successor's mirror, or the
  shard's part of the last snapshot -- with per-row bookkeeping (see [Note: exact and
  stale rows]).
- `restore_shard`: when a worker dies, its shard is rebuilt row by row from the freshest
  surviving copy; `RestoredShard` says which rows came back exact and which stale, and
  how many lookups' updates were lost. Survivors keep their state (no rollback).
- `portion_of_lost_samples` (PLS) and `decide`: the policy ``embedding="exact"`` accepts
  only an exact restore; ``"partial"`` accepts lost updates up to a PLS budget; beyond it,
  the job rolls back to the last snapshot.

CPR (MLSys'21, RESEARCH.md) restores only the failed node's shards from the last
checkpoint and keeps everybody else training; it saves the most frequently used rows more
often (CPR-MFU). We keep the hot rows current on a peer every step, so most lost lookups
come back exact and only cold rows come back stale.

[Note: exact and stale rows]
Steps are counted as *committed steps*: a copy taken after step ``t`` was committed
reflects ``t + 1`` steps. A `ShardCopy` keeps, per row, ``copied_at`` (the committed steps
its copy of the row reflects) and ``pending`` (lookups of the row in committed steps
after its copy: the sample updates the copy lacks). Every copy hears every step's
``(rows updated, lookups)`` (ints, from the owner's `MirrorUpdate`) whether or not it
receives values, so ``pending`` is exact. A row restored from a copy is *exact* iff its
``pending`` is 0 -- it is bit-identical to the lost row, since only lookups update a row
(row-wise Adagrad leaves untouched rows alone) -- and *stale* otherwise. `restore_shard`
takes each row from the copy with the largest ``copied_at`` (the first copy given wins
ties, so pass the mirror first). After a restore every surviving copy is `rebase`\\ d:
its ``pending`` drops by the lookups the restore lost, so it again counts the updates
the *restored* row has and the copy lacks.

[Note: portion of lost samples]
CPR's PLS is the fraction of training samples whose updates were lost. We count it per
lookup: sample ``i`` of step ``u`` looking up row ``r`` through feature ``t`` lost its
update to ``r`` iff ``r`` was restored from a copy taken before step ``u`` (``u >=
copied_at[r]``). A sample counts for the fraction of its ``T`` lookups that were lost, so
an event's lost samples are ``lost lookups / T`` and its PLS is that over the samples
trained so far (committed steps x global batch). With rows restored from a checkpoint
``k`` steps old on a worker holding a share ``f`` of the lookups this is ``k f / steps``,
CPR's ``failures x (interval / 2) x share / samples`` in expectation. The job's PLS is
the sum over events of lost samples over samples trained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from parallelism.checks import check_fraction, check_index, check_number, check_positive_int
from recovery.names import Strategy

__all__ = [
    "EMBEDDING_POLICIES",
    "EmbeddingPolicy",
    "MFUTracker",
    "MirrorCost",
    "MirrorPlan",
    "MirrorUpdate",
    "RestoredShard",
    "ShardCopy",
    "decide",
    "mirror_cost",
    "mirror_update",
    "mirror_update_before_commit",
    "portion_of_lost_samples",
    "restore_shard",
]

EmbeddingPolicy = Literal["partial", "exact"]
"""``exact``: roll back whenever a lost row has no current copy; ``partial``: accept
stale rows while the job's PLS stays within its budget."""
EMBEDDING_POLICIES: tuple[EmbeddingPolicy, ...] = get_args(EmbeddingPolicy)

_INDEX_BYTES = 8  # an int64 row index or count on the wire


def _check_rows(rows: Tensor, num_rows: int, what: str) -> None:
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(f"{what} must be a 1-D int64 tensor, got {rows.dtype} {tuple(rows.shape)}")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise ValueError(f"{what} hold a row outside 0..{num_rows - 1}")


# ---- MFU tracking ----------------------------------------------------------------------


class MFUTracker:
    """Lookup counters of one shard's rows: which rows are the most frequently used.

    Args:
        num_rows: rows of the shard.
        counts: initial counts (e.g. a restored shard's `RestoredShard.lookups`).

    Raises:
        ValueError: if ``num_rows`` is not positive or ``counts`` does not match it.
    """

    def __init__(self, num_rows: int, counts: Tensor | None = None) -> None:
        check_positive_int("num_rows", num_rows)
        if counts is not None and (counts.shape != (num_rows,) or counts.dtype != torch.int64):
            raise ValueError(
                f"counts must be [{num_rows}] int64, got {tuple(counts.shape)} {counts.dtype}"
            )
        self.num_rows = num_rows
        self.counts = (
            counts.clone() if counts is not None else torch.zeros(num_rows, dtype=torch.int64)
        )

    def observe(self, rows: Tensor, lookups: Tensor) -> None:
        """Add one step's lookups (``rows`` unique local rows, ``lookups`` their counts).

        Raises:
            ValueError: if the rows are out of range or the tensors do not match.
        """
        _check_rows(rows, self.num_rows, "rows")
        if lookups.shape != rows.shape:
            raise ValueError(f"lookups {tuple(lookups.shape)} must match rows {tuple(rows.shape)}")
        self.counts.index_add_(0, rows, lookups.to(torch.int64))

    def hot(self, k: int) -> Tensor:
        """The ``k`` most looked-up rows, ascending; ties go to the lower row, never-used
        rows are never hot (so fewer than ``k`` may come back).

        Raises:
            ValueError: if ``k`` is negative.
        """
        check_index("k", k)
        k = min(k, self.num_rows)
        if k == 0:
            return torch.zeros(0, dtype=torch.int64)
        # One unique key per row: count first, then the lower row. No ties, so topk's
        # choice is fully determined.
        keys = self.counts * self.num_rows + (self.num_rows - 1 - torch.arange(self.num_rows))
        top = torch.topk(keys, k, sorted=False).indices
        top = top[self.counts[top] > 0]
        return torch.sort(top).values


# ---- the mirror ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MirrorPlan:
    """What the owner of a shard sends its ring successor after each committed step.

    Raises:
        ValueError: if ``hot_rows`` is negative or ``mirror_every`` is not positive.
    """

    hot_rows: int = 0
    """The most frequently used rows (`MFUTracker.hot`) mirrored after every step."""
    mirror_every: int = 1
    """All rows are mirrored after every this many committed steps (1: every step, which
    makes every restore exact)."""
    hot_every: int = 1
    """The hot set (the top ``hot_rows`` of the counters, a top-k over the shard) is
    chosen again after every this many committed steps; in between, the last set chosen
    is sent (its values are always current). Callers that keep that set pass it to
    `mirror_update` as ``hot``; 1: chosen every step."""

    def __post_init__(self) -> None:
        if isinstance(self.hot_rows, bool) or not isinstance(self.hot_rows, int):
            raise ValueError(f"hot_rows must be an integer, got {self.hot_rows!r}")
        if self.hot_rows < 0:
            raise ValueError(f"hot_rows must be >= 0, got {self.hot_rows}")
        check_positive_int("mirror_every", self.mirror_every)
        check_positive_int("hot_every", self.hot_every)

    def is_full(self, committed: int) -> bool:
        """Whether the update after ``committed`` committed steps carries every row."""
        return committed % self.mirror_every == 0

    def hot_set(self, tracker: MFUTracker, committed: int, last: Tensor | None) -> Tensor:
        """The hot rows the update after ``committed`` steps carries: ``last`` (the set
        chosen before), or a new choice when none was made or ``hot_every`` is due."""
        if last is None or committed % self.hot_every == 0:
            return tracker.hot(self.hot_rows)
        return last


@dataclass(frozen=True)
class MirrorUpdate:
    """One step's message from a shard's owner to the holder of its mirror."""

    shard: int
    committed: int
    """Committed steps of the shard after this step (the values sent reflect them)."""
    updated: Tensor
    """Rows the step updated (unique, int64)."""
    lookups: Tensor
    """Lookups of each updated row in the step."""
    rows: Tensor
    """Rows whose values are sent (hot rows, or all rows on a full update)."""
    weight: Tensor
    """``[len(rows), dim]`` values of those rows."""
    accumulator: Tensor
    """``[len(rows)]`` optimizer state of those rows."""
    full: bool

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (row indices are implicit on a full update)."""
        values = self.weight.numel() * self.weight.element_size()
        values += self.accumulator.numel() * self.accumulator.element_size()
        indices = 0 if self.full else self.rows.numel() * _INDEX_BYTES
        return values + indices + 2 * self.updated.numel() * _INDEX_BYTES


def mirror_update(
    plan: MirrorPlan,
    *,
    shard: int,
    committed: int,
    weight: Tensor,
    accumulator: Tensor,
    tracker: MFUTracker,
    updated: Tensor,
    lookups: Tensor,
    hot: Tensor | None = None,
) -> MirrorUpdate:
    """The owner's message after committing a step (call after `MFUTracker.observe`).

    Args:
        committed: the shard's committed steps, this step included.
        hot: the hot set the last update carried (see `MirrorPlan.hot_every`).
        weight, accumulator: the shard's current rows and row-wise optimizer state.
        updated, lookups: the step's updated rows and their lookups
            (`parallelism.workloads.dlrm.StepUpdate`).

    Raises:
        ValueError: if the shapes do not match the tracker's shard.
    """
    n = tracker.num_rows
    if weight.dim() != 2 or weight.shape[0] != n or accumulator.shape != (n,):
        raise ValueError(
            f"weight {tuple(weight.shape)} and accumulator {tuple(accumulator.shape)} do not "
            f"match the tracker's {n} rows"
        )
    _check_rows(updated, n, "updated rows")
    full = plan.is_full(committed)
    if full:
        rows = torch.arange(n)
        values, state = weight.detach().clone(), accumulator.detach().clone()
    else:
        rows = plan.hot_set(tracker, committed, hot)
        values, state = weight.detach()[rows], accumulator.detach()[rows]
    return MirrorUpdate(
        shard=shard,
        committed=committed,
        updated=updated.clone(),
        lookups=lookups.to(torch.int64).clone(),
        rows=rows,
        weight=values,
        accumulator=state,
        full=full,
    )


def mirror_update_before_commit(
    plan: MirrorPlan,
    *,
    shard: int,
    committed: int,
    weight: Tensor,
    accumulator: Tensor,
    counts: Tensor,
    rows: Tensor,
    grads: Tensor,
    lookups: Tensor,
    lr: float,
    eps: float,
    hot: Tensor | None = None,
) -> MirrorUpdate:
    """The `mirror_update` the owner would send after committing a step, computed before
    the commit from the step's pending row gradients (the runtime sends it in phase one,
    so that the commit stays local; the holder applies it when the step commits).

    Only the rows the update carries are computed, with the same row-wise Adagrad
    (`parallelism.workloads.dlrm.rowwise_adagrad_`) the commit applies -- each row's update depends
    on that row alone, so the values are bit-identical to the committed ones.

    Args:
        committed: the shard's committed steps once this step commits.
        weight, accumulator: the shard's rows and row-wise state before the commit.
        counts: the shard's lookup counts before this step (`MFUTracker.counts`).
        rows, grads, lookups: the pending step's updated rows (unique, ascending), their
            summed gradients and their lookups (`parallelism.workloads.dlrm.DLRMWorker.pending`).
        hot: the hot set the last update carried (see `MirrorPlan.hot_every`).

    Raises:
        ValueError: if the shapes do not match.
    """
    from parallelism.workloads.dlrm import rowwise_adagrad_

    n = int(weight.shape[0])
    tracker = MFUTracker(n, counts)
    tracker.observe(rows, lookups)
    if grads.shape != (rows.numel(), weight.shape[1]):
        raise ValueError(
            f"grads {tuple(grads.shape)} must be [{rows.numel()}, {weight.shape[1]}] like rows"
        )
    full = plan.is_full(committed)
    send = torch.arange(n) if full else plan.hot_set(tracker, committed, hot)
    values = weight.detach()[send]
    state = accumulator.detach()[send]
    if send.numel() and rows.numel():
        at = torch.searchsorted(send, rows).clamp(max=send.numel() - 1)
        hit = send[at] == rows
        rowwise_adagrad_(values, state, at[hit], grads[hit], lr=lr, eps=eps)
    return MirrorUpdate(
        shard=shard,
        committed=committed,
        updated=rows.clone(),
        lookups=lookups.to(torch.int64).clone(),
        rows=send,
        weight=values,
        accumulator=state,
        full=full,
    )


@dataclass(frozen=True)
class MirrorCost:
    """What mirroring one shard costs: the holder's memory and the owner's traffic."""

    memory_bytes: int
    """The copy (weights, optimizer state) plus its bookkeeping (3 int64 per row)."""
    hot_bytes: int
    """Traffic of an ordinary step's update: the hot rows and their indices."""
    full_bytes: int
    """Traffic of a full update: every row."""
    bookkeeping_bytes: float
    """Traffic of a step's updated rows and lookup counts (ints), every step."""
    mean_bytes_per_step: float
    """Average traffic per step over a ``mirror_every`` cycle, bookkeeping included."""


def mirror_cost(
    plan: MirrorPlan, *, num_rows: int, dim: int, updated_rows_per_step: float
) -> MirrorCost:
    """Memory and traffic of mirroring a shard of ``num_rows`` rows of width ``dim`` (float32).

    Raises:
        ValueError: for a non-positive size or a negative rate.
    """
    check_positive_int("num_rows", num_rows)
    check_positive_int("dim", dim)
    check_number("updated_rows_per_step", updated_rows_per_step, minimum=0)
    row = 4 * dim + 4  # weight row + row-wise Adagrad state, float32
    hot = min(plan.hot_rows, num_rows)
    hot_bytes = hot * (row + _INDEX_BYTES)
    full_bytes = num_rows * row
    mean_values = (full_bytes + (plan.mirror_every - 1) * hot_bytes) / plan.mirror_every
    return MirrorCost(
        memory_bytes=num_rows * (row + 3 * _INDEX_BYTES),
        hot_bytes=hot_bytes,
        full_bytes=full_bytes,
        bookkeeping_bytes=2 * _INDEX_BYTES * updated_rows_per_step,
        mean_bytes_per_step=mean_values + 2 * _INDEX_BYTES * updated_rows_per_step,
    )


# ---- copies of a shard -----------------------------------------------------------------


@dataclass
class ShardCopy:
    """A copy of one shard kept off its owner: a peer's mirror or a snapshot's shard part.

    See [Note: exact and stale rows]. Mutable: `apply`, `record` and `refresh` update it
    in place as the owner's messages arrive.
    """

    shard: int
    weight: Tensor
    """``[rows, dim]`` the copied rows."""
    accumulator: Tensor
    """``[rows]`` their row-wise optimizer state."""
    copied_at: Tensor
    """``[rows]`` int64: committed steps each row's copy reflects."""
    pending: Tensor
    """``[rows]`` int64: lookups of each row after its copy (updates the copy lacks)."""
    lookups: Tensor
    """``[rows]`` int64: all lookups of each row so far (restores the MFU tracker)."""

    @classmethod
    def take(
        cls,
        shard: int,
        weight: Tensor,
        accumulator: Tensor,
        *,
        committed: int,
        lookups: Tensor | None = None,
    ) -> ShardCopy:
        """A full copy of a shard after ``committed`` steps (its owner's current state).

        Raises:
            ValueError: if the shapes do not match.
        """
        n = int(weight.shape[0])
        if weight.dim() != 2 or accumulator.shape != (n,):
            raise ValueError(
                f"weight {tuple(weight.shape)} and accumulator {tuple(accumulator.shape)} "
                "must be [rows, dim] and [rows]"
            )
        if lookups is not None and lookups.shape != (n,):
            raise ValueError(f"lookups must be [{n}], got {tuple(lookups.shape)}")
        return cls(
            shard=shard,
            weight=weight.detach().clone(),
            accumulator=accumulator.detach().clone(),
            copied_at=torch.full((n,), committed, dtype=torch.int64),
            pending=torch.zeros(n, dtype=torch.int64),
            lookups=(
                lookups.to(torch.int64).clone()
                if lookups is not None
                else torch.zeros(n, dtype=torch.int64)
            ),
        )

    @property
    def num_rows(self) -> int:
        return int(self.weight.shape[0])

    @property
    def nbytes(self) -> int:
        """Memory held: values plus bookkeeping."""
        tensors = (self.weight, self.accumulator, self.copied_at, self.pending, self.lookups)
        return sum(t.numel() * t.element_size() for t in tensors)

    def record(self, updated: Tensor, lookups: Tensor) -> None:
        """Note a committed step's updated rows and lookups (no values).

        Raises:
            ValueError: if a row is out of range or the tensors do not match.
        """
        _check_rows(updated, self.num_rows, "updated rows")
        if lookups.shape != updated.shape:
            raise ValueError(
                f"lookups {tuple(lookups.shape)} must match rows {tuple(updated.shape)}"
            )
        counts = lookups.to(torch.int64)
        self.pending.index_add_(0, updated, counts)
        self.lookups.index_add_(0, updated, counts)

    def refresh(self, rows: Tensor, weight: Tensor, accumulator: Tensor, *, committed: int) -> None:
        """Overwrite ``rows`` with their values after ``committed`` steps.

        Raises:
            ValueError: if the shapes do not match, before anything is written.
        """
        self._check_values(rows, weight, accumulator)
        self.weight[rows] = weight
        self.accumulator[rows] = accumulator
        self.copied_at[rows] = committed
        self.pending[rows] = 0

    def apply(self, update: MirrorUpdate) -> None:
        """Take an owner's `MirrorUpdate`: record its lookups, then refresh its rows.

        Raises:
            ValueError: if the update is for another shard or does not fit, before
                anything is written.
        """
        if update.shard != self.shard:
            raise ValueError(f"an update of shard {update.shard} sent to the copy of {self.shard}")
        self._check_values(update.rows, update.weight, update.accumulator)
        if update.full and update.rows.numel() != self.num_rows:
            raise ValueError(
                f"a full update of {update.rows.numel()} rows sent to a copy of {self.num_rows}"
            )
        self.record(update.updated, update.lookups)
        if update.full:  # every row, in order: plain copies, no indexing
            self.weight.copy_(update.weight)
            self.accumulator.copy_(update.accumulator)
            self.copied_at.fill_(update.committed)
            self.pending.zero_()
        else:
            self.refresh(update.rows, update.weight, update.accumulator, committed=update.committed)

    def _check_values(self, rows: Tensor, weight: Tensor, accumulator: Tensor) -> None:
        _check_rows(rows, self.num_rows, "rows")
        if weight.shape != (rows.numel(), self.weight.shape[1]) or accumulator.shape != (
            rows.numel(),
        ):
            raise ValueError(
                f"values {tuple(weight.shape)} / {tuple(accumulator.shape)} do not match "
                f"{rows.numel()} rows of width {self.weight.shape[1]}"
            )

    def rebase(self, restored: RestoredShard) -> None:
        """After `restore_shard` rebuilt this copy's shard: count only the updates the
        restored rows hold and this copy lacks. See [Note: exact and stale rows].

        Raises:
            ValueError: if ``restored`` is another shard's or lost updates this copy
                never saw (it was not one of the restore's sources' peers).
        """
        if restored.shard != self.shard or restored.lost.shape != self.pending.shape:
            raise ValueError(f"restored shard {restored.shard} does not match copy {self.shard}")
        pending = self.pending - restored.lost
        if bool((pending < 0).any()):
            raise ValueError(
                f"copy of shard {self.shard} is fresher than the restore's chosen source for "
                "some row; restore_shard must be given every surviving copy"
            )
        self.pending = pending

    def clone(self) -> ShardCopy:
        return ShardCopy(
            shard=self.shard,
            weight=self.weight.clone(),
            accumulator=self.accumulator.clone(),
            copied_at=self.copied_at.clone(),
            pending=self.pending.clone(),
            lookups=self.lookups.clone(),
        )


# ---- restore ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RestoredShard:
    """A lost shard rebuilt from surviving copies (nothing written anywhere yet)."""

    shard: int
    weight: Tensor
    accumulator: Tensor
    exact: Tensor
    """``[rows]`` bool: the row is bit-identical to the lost one."""
    source: Tensor
    """``[rows]`` int64: which of the given copies each row came from."""
    copied_at: Tensor
    """``[rows]`` int64: committed steps the restored row reflects."""
    lost: Tensor
    """``[rows]`` int64: lookups whose updates to the row were lost."""
    lookups: Tensor
    """``[rows]`` int64: all lookups so far (seed the new owner's `MFUTracker`)."""

    @property
    def rows_exact(self) -> int:
        return int(self.exact.sum())

    @property
    def rows_stale(self) -> int:
        return int(self.exact.numel()) - self.rows_exact

    @property
    def lost_lookups(self) -> int:
        return int(self.lost.sum())


def restore_shard(copies: Sequence[ShardCopy]) -> RestoredShard:
    """Rebuild a lost shard row by row from the freshest of the surviving ``copies``.

    Pass the mirror first (it wins ties), then the snapshot. Nothing is modified; load the
    result into the replacement worker and `ShardCopy.rebase` the surviving copies.

    Raises:
        ValueError: if no copy is given, or the copies are of different shards or shapes.
    """
    if not copies:
        raise ValueError(
            "no surviving copy of the lost shard (its mirror holder died too and there is no "
            "snapshot); the job must restart from a checkpoint"
        )
    first = copies[0]
    for c in copies[1:]:
        if c.shard != first.shard or c.weight.shape != first.weight.shape:
            raise ValueError(
                f"copies disagree: shard {c.shard} {tuple(c.weight.shape)} vs "
                f"shard {first.shard} {tuple(first.weight.shape)}"
            )
    copied_at = torch.stack([c.copied_at for c in copies])
    # argmax of (copied_at, -index): the freshest copy, the first one on ties.
    order = torch.arange(len(copies), 0, -1, dtype=torch.int64)[:, None]
    source = torch.argmax(copied_at * (len(copies) + 1) + order, dim=0)
    weight = first.weight.clone()
    accumulator = first.accumulator.clone()
    pending = first.pending.clone()
    for i, c in enumerate(copies[1:], start=1):
        take = source == i
        weight[take] = c.weight[take]
        accumulator[take] = c.accumulator[take]
        pending[take] = c.pending[take]
    lookups = torch.stack([c.lookups for c in copies]).max(dim=0).values
    return RestoredShard(
        shard=first.shard,
        weight=weight,
        accumulator=accumulator,
        exact=pending == 0,
        source=source,
        copied_at=copied_at.gather(0, source[None, :])[0],
        lost=pending,
        lookups=lookups,
    )


# ---- PLS and policy --------------------------------------------------------------------


def portion_of_lost_samples(lost_lookups: int, *, lookups_per_sample: int, samples: int) -> float:
    """PLS: lost lookups over lookups per sample, over samples trained.

    See [Note: portion of lost samples]. ``samples`` is the number of samples in the
    committed steps (committed steps x global batch).

    Raises:
        ValueError: for negative counts or a non-positive ``lookups_per_sample``.
    """
    if lost_lookups < 0:
        raise ValueError(f"lost_lookups must be >= 0, got {lost_lookups}")
    check_positive_int("lookups_per_sample", lookups_per_sample)
    check_index("samples", samples)
    if samples == 0:
        return 0.0 if lost_lookups == 0 else math.inf
    return lost_lookups / lookups_per_sample / samples


def decide(
    embedding: str, *, pls: float, budget: float
) -> Literal[Strategy.EMBEDDING_PARTIAL, Strategy.ROLLBACK]:
    """Recover the lost shard in place (`Strategy.EMBEDDING_PARTIAL`) or roll the job back
    (`Strategy.ROLLBACK`).

    ``pls`` is the job's PLS with this event included: the lost samples of the events it
    accepted (and did not later roll back) and of this one, over the samples trained.
    ``exact`` accepts only if nothing was lost (``pls == 0``: every lost row came back
    exact); ``partial`` accepts while ``pls <= budget``.

    Raises:
        ValueError: for an unknown policy or a budget outside [0, 1].
    """
    if embedding not in EMBEDDING_POLICIES:
        raise ValueError(f"embedding must be one of {EMBEDDING_POLICIES}, got {embedding!r}")
    check_fraction("PLS budget", budget)
    check_number("pls", pls, minimum=0, allow_inf=True)
    if embedding == "exact":
        return Strategy.EMBEDDING_PARTIAL if pls == 0 else Strategy.ROLLBACK
    return Strategy.EMBEDDING_PARTIAL if pls <= budget else Strategy.ROLLBACK
