"""What the job may do when workers die: `RecoveryPolicy`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from recovery.names import Strategy

if TYPE_CHECKING:
    from recovery.strategies.checkfree import CheckFreeConfig
    from recovery.strategies.embedding import MirrorPlan

STRATEGIES = ("auto", "restart")
APPROXIMATIONS = (None, "checkfree", "checkfree+")
STRATEGY_NAMES = tuple(s.value for s in Strategy if s is not Strategy.RESTART)
"""The recovery strategies a policy can allow (see docs/DESIGN.md, Recovery hierarchy)."""


def _positive_int(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive integer or None" if optional else "a positive integer"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _default_checkfree() -> CheckFreeConfig:
    from recovery.strategies.checkfree import CheckFreeConfig

    return CheckFreeConfig()


@dataclass(frozen=True, kw_only=True)
class RecoveryPolicy:
    """How failures are handled.

    Raises:
        ValueError: naming the bad field and value.
    """

    strategy: str = "auto"
    """``"auto"``: the recovery hierarchy (rebuild lost workers from live redundancy, roll
    back only when it is exhausted). ``"restart"``: the baseline torchrun and Ray Train
    implement -- tear down every worker, start new ones, load the last checkpoint, redo the
    lost steps."""
    approximate: str | None = None
    """Approximate rebuilds of a stage that lost every replica: ``None`` (never),
    ``"checkfree"`` (intermediate stages, from their neighbours), ``"checkfree+"`` (also the
    first and last stages; trains with swapped routes and (de)embedding replicas)."""
    exact_only: bool = False
    """Never rebuild approximately, whatever ``approximate`` says: exhausted redundancy
    means rollback."""
    allowed: tuple[str, ...] | None = None
    """Restrict the strategies the planner may use (names in `STRATEGY_NAMES`); None: all."""
    checkfree: CheckFreeConfig = field(default_factory=_default_checkfree)
    """The knobs of CheckFree(+) rebuilds (averaging, learning-rate scale, optimizer reset)."""
    snapshot_every: int | None = 50
    """Peer-memory snapshots: every this many steps each worker keeps a copy of its state
    and sends one to a buddy on another node. None: off."""
    durable_every: int | None = None
    """Durable snapshots (torch.distributed.checkpoint, checksummed) every this many steps.
    None: off. Needed to survive the loss of the driver."""
    snapshot_dir: str | os.PathLike[str] | None = None
    """Where durable snapshots go (default: ``<run folder>/snapshots``)."""
    keep_durable: int = 2
    """Durable snapshots kept on disk (older ones are deleted)."""
    hot_spares: int = 0
    """Warm spare workers kept ready (torch imported, stage modules built) to replace dead
    ones without a cold start."""
    hang_timeout_s: float = 120.0
    """A step that makes no progress for this long is a hang: the stuck worker is killed and
    replaced. Must exceed the slowest healthy step."""
    max_recoveries: int | None = None
    """Give up (``RecoveryError``) after this many recoveries; None: never."""
    embedding: str = "partial"
    """Embedding tables (`TrainSpec.dlrm`): how a lost shard may come back when some of its
    rows have no current copy. ``"partial"`` (CPR): restore those rows stale from the
    mirror's last full copy while the portion of lost samples stays within
    ``pls_budget``, survivors keep training; ``"exact"``: roll back instead."""
    pls_budget: float = 0.05
    """The job's portion of lost samples (PLS) that ``embedding="partial"`` accepts."""
    mirror_hot_rows: int = 1024
    """Embedding tables: the most frequently used rows of each shard mirrored on the ring
    neighbour after every step."""
    mirror_every: int = 10
    """Embedding tables: every row of each shard mirrored after every this many steps
    (1: every step, which makes every restore exact)."""
    mirror_hot_every: int = 10
    """Embedding tables: the hot rows are chosen again (a top-k of each shard's lookup
    counters) after every this many steps; in between the same rows are mirrored."""
    checkpoint_every: int = 50
    """``restart`` only: write a checkpoint (torch.distributed.checkpoint) every this many steps."""
    checkpoint_dir: str | os.PathLike[str] | None = None
    """``restart`` only: where checkpoints go (default: the run folder, else a temp folder)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown recovery strategy {self.strategy!r}; choose one of {STRATEGIES}"
            )
        if self.approximate not in APPROXIMATIONS:
            raise ValueError(
                f"approximate must be one of {APPROXIMATIONS}, got {self.approximate!r}"
            )
        if self.allowed is not None:
            unknown = sorted(set(self.allowed) - set(STRATEGY_NAMES))
            if unknown:
                raise ValueError(
                    f"unknown strategies {unknown} in allowed; known: {STRATEGY_NAMES}"
                )
        if (
            isinstance(self.hot_spares, bool)
            or not isinstance(self.hot_spares, int)
            or self.hot_spares < 0
        ):
            raise ValueError(f"hot_spares must be a non-negative integer, got {self.hot_spares!r}")
        if not (
            isinstance(self.hang_timeout_s, int | float)
            and self.hang_timeout_s > 0
            and math.isfinite(self.hang_timeout_s)
        ):
            raise ValueError(
                f"hang_timeout_s must be a positive number of seconds, got {self.hang_timeout_s!r}"
            )
        if self.max_recoveries is not None and (
            not isinstance(self.max_recoveries, int) or self.max_recoveries < 0
        ):
            raise ValueError(f"max_recoveries must be >= 0 or None, got {self.max_recoveries!r}")
        from recovery.strategies.embedding import EMBEDDING_POLICIES

        if self.embedding not in EMBEDDING_POLICIES:
            raise ValueError(
                f"embedding must be one of {EMBEDDING_POLICIES}, got {self.embedding!r}"
            )
        if not (
            isinstance(self.pls_budget, int | float)
            and not isinstance(self.pls_budget, bool)
            and 0 <= self.pls_budget <= 1
        ):
            raise ValueError(f"pls_budget must be in [0, 1], got {self.pls_budget!r}")
        if (
            isinstance(self.mirror_hot_rows, bool)
            or not isinstance(self.mirror_hot_rows, int)
            or self.mirror_hot_rows < 0
        ):
            raise ValueError(
                f"mirror_hot_rows must be a non-negative integer, got {self.mirror_hot_rows!r}"
            )
        _positive_int("mirror_every", self.mirror_every)
        _positive_int("mirror_hot_every", self.mirror_hot_every)
        _positive_int("checkpoint_every", self.checkpoint_every)
        _positive_int("snapshot_every", self.snapshot_every, optional=True)
        _positive_int("durable_every", self.durable_every, optional=True)
        _positive_int("keep_durable", self.keep_durable)

    def allows(self, strategy: str) -> bool:
        """Whether the planner may use ``strategy``."""
        return self.allowed is None or strategy in self.allowed

    @property
    def mirror_plan(self) -> MirrorPlan:
        """What each embedding shard's owner sends its mirror after every step."""
        from recovery.strategies.embedding import MirrorPlan

        return MirrorPlan(
            hot_rows=self.mirror_hot_rows,
            mirror_every=self.mirror_every,
            hot_every=self.mirror_hot_every,
        )

    @property
    def swapped_routes(self) -> bool:
        """CheckFree+ trains with the first two and last two stages swapped on odd microbatches."""
        return self.approximate == "checkfree+" and not self.exact_only
