"""What an embedding run is: the job every strategy shares (`EmbeddingSetup`), how one
strategy recovers (`EmbeddingStrategy`, the default comparison), and the failure schedule
they all meet. See [Note: embedding simulator model] in `simulations.embedding`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from parallelism.checks import check_int, check_number
from parallelism.workloads.clicks import ClickLogs
from parallelism.workloads.dlrm import DLRMConfig, ShardLayout
from recovery.faults import FailureSchedule, Kill
from recovery.names import Strategy
from recovery.strategies.embedding import EMBEDDING_POLICIES, MirrorPlan
from simulations.policies import SimulatedPolicy

__all__ = [
    "RECOVERIES",
    "EmbeddingSetup",
    "EmbeddingStrategy",
    "default_strategies",
    "failure_schedule",
]

RECOVERIES = (SimulatedPolicy.NONE, Strategy.ROLLBACK, SimulatedPolicy.PARTIAL)
"""How a run recovers: see [Note: embedding simulator model]."""


def _check(owner: str, name: str, value: object, *, positive: bool = True) -> None:
    check_number(f"{owner}.{name}", value, positive=positive, minimum=None if positive else 0.0)


def _check_int(owner: str, name: str, value: object, *, minimum: int = 1) -> None:
    check_int(f"{owner}.{name}", value, minimum=minimum)


@dataclass(frozen=True, kw_only=True)
class EmbeddingSetup:
    """The model, data and training run every strategy shares.

    Raises:
        ValueError: naming a bad field and value.
    """

    preset: str = "small"
    """`parallelism.dlrm.DLRMConfig` preset."""
    workers: int = 4
    """Workers: shards of every table and data-parallel replicas of the dense part."""
    batch_size: int = 256
    """Samples per worker per step."""
    steps: int = 1500
    """Committed steps of a run."""
    seed: int = 0
    """Seeds the weights, the data and its planted truth."""
    sparse_lr: float = 0.05
    """Row-wise Adagrad learning rate of the embedding rows."""
    dense_lr: float = 1e-3
    """Adam learning rate of the dense part."""
    zipf_alpha: float = 1.05
    """Zipf exponent of the feature ids."""
    heldout: int = 20_000
    """Held-out samples for AUC and log loss."""
    eval_every: int = 100
    """Evaluate every this many committed steps (and at the end)."""

    def __post_init__(self) -> None:
        for name in ("workers", "batch_size", "steps", "heldout", "eval_every"):
            _check_int("EmbeddingSetup", name, getattr(self, name))
        _check_int("EmbeddingSetup", "seed", self.seed, minimum=0)
        for name in ("sparse_lr", "dense_lr", "zipf_alpha"):
            _check("EmbeddingSetup", name, getattr(self, name))
        self.config()  # an unknown preset raises here
        ShardLayout(self.config().table_rows, self.workers)  # tables too small raise here

    def config(self) -> DLRMConfig:
        return DLRMConfig.preset(self.preset)

    def logs(self) -> ClickLogs:
        config = self.config()
        return ClickLogs(
            config.table_rows,
            dense_features=config.dense_features,
            batch_size=self.batch_size,
            seed=self.seed,
            zipf_alpha=self.zipf_alpha,
        )


@dataclass(frozen=True, kw_only=True)
class EmbeddingStrategy:
    """How a run recovers from a dead worker.

    Raises:
        ValueError: naming a bad field and value.
    """

    name: str
    """A label for tables and plots."""
    recovery: str
    """One of `RECOVERIES`: no failures, `Strategy.ROLLBACK`, or CPR (`SimulatedPolicy.PARTIAL`)."""
    embedding: str = "partial"
    """``partial`` only: the policy, ``"partial"`` (accept stale rows within the PLS
    budget) or ``"exact"`` (roll back unless every lost row came back exact)."""
    pls_budget: float = 0.05
    """``partial`` only: the job's PLS beyond which a failure rolls back instead."""
    mirror: MirrorPlan | None = None
    """``partial`` only: shard mirrors on the ring successor (None: snapshots only, CPR)."""
    checkpoint_every: int | None = None
    """Steps between checkpoints; None: the time model's optimal interval."""

    def __post_init__(self) -> None:
        if self.recovery not in RECOVERIES:
            raise ValueError(
                f"EmbeddingStrategy.recovery must be one of {RECOVERIES}, got {self.recovery!r}"
            )
        if self.embedding not in EMBEDDING_POLICIES:
            raise ValueError(
                f"EmbeddingStrategy.embedding must be one of {EMBEDDING_POLICIES}, "
                f"got {self.embedding!r}"
            )
        if not (isinstance(self.pls_budget, int | float) and 0 <= self.pls_budget <= 1):
            raise ValueError(
                f"EmbeddingStrategy.pls_budget must be in [0, 1], got {self.pls_budget!r}"
            )
        if self.checkpoint_every is not None:
            _check_int("EmbeddingStrategy", "checkpoint_every", self.checkpoint_every)
        if self.mirror is not None and self.recovery != SimulatedPolicy.PARTIAL:
            raise ValueError(f"strategy {self.name!r}: mirrors are used by 'partial' recovery only")


def default_strategies(
    *,
    hot_rows: int = 4096,
    mirror_every: int = 100,
    pls_budget: float = 0.05,
    partial_checkpoint_every: int | None = None,
) -> list[EmbeddingStrategy]:
    """The comparison: no failures, full rollback, CPR from snapshots, CPR with MFU
    mirrors, and exact recovery from mirrors refreshed every step.

    Every strategy checkpoints at the time model's optimal interval unless
    ``partial_checkpoint_every`` sets another one for the partial strategies (a partial
    recovery does not redo work, so the rollback-optimal interval is not theirs).
    """
    every = partial_checkpoint_every
    return [
        EmbeddingStrategy(name="no failures", recovery=SimulatedPolicy.NONE),
        EmbeddingStrategy(name="full rollback", recovery=Strategy.ROLLBACK),
        EmbeddingStrategy(
            name="CPR (snapshots)",
            recovery=SimulatedPolicy.PARTIAL,
            pls_budget=pls_budget,
            checkpoint_every=every,
        ),
        EmbeddingStrategy(
            name="CPR + MFU mirrors",
            recovery=SimulatedPolicy.PARTIAL,
            pls_budget=pls_budget,
            mirror=MirrorPlan(hot_rows=hot_rows, mirror_every=mirror_every),
            checkpoint_every=every,
        ),
        EmbeddingStrategy(
            name="exact mirrors",
            recovery=SimulatedPolicy.PARTIAL,
            embedding="exact",
            mirror=MirrorPlan(hot_rows=0, mirror_every=1),
            checkpoint_every=every,
        ),
    ]


def failure_schedule(*, steps: int, workers: int, failures: int, seed: int = 0) -> FailureSchedule:
    """``failures`` kills of single workers at distinct steps spread over the run.

    Step ``i`` of ``failures`` is drawn uniformly inside the ``i``-th of equal slices of
    steps ``[steps // 10, steps)`` (so failures neither bunch up nor hit the very first
    steps); the worker is drawn uniformly. Deterministic in ``seed``.

    Raises:
        ValueError: if ``failures`` is negative or does not fit in the steps.
    """
    _check_int("failure_schedule", "failures", failures, minimum=0)
    start = steps // 10
    if failures > steps - start:
        raise ValueError(f"{failures} failures do not fit in {steps - start} steps")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 31]))
    edges = np.linspace(start, steps, failures + 1)
    kills = []
    for i in range(failures):
        lo = math.ceil(edges[i])
        hi = max(lo + 1, int(edges[i + 1]))
        kills.append(
            Kill(step=int(rng.integers(lo, hi)), stage=0, replica=int(rng.integers(0, workers)))
        )
    return FailureSchedule(kills)
