"""What the job may do when workers die: `RecoveryPolicy`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

STRATEGIES = ("auto", "restart")


@dataclass(frozen=True, kw_only=True)
class RecoveryPolicy:
    """How failures are handled.

    Raises:
        ValueError: naming the bad field and value.
    """

    strategy: str = "auto"
    """``"auto"``: the recovery hierarchy (rebuild lost workers from live redundancy, see
    docs/DESIGN.md). ``"restart"``: the baseline torchrun and Ray Train implement -- tear
    down every worker, start new ones, load the last checkpoint, redo the lost steps."""
    hot_spares: int = 0
    """Warm spare workers kept ready (torch imported, stage modules built) to replace dead
    ones without a cold start."""
    hang_timeout_s: float = 120.0
    """A step that makes no progress for this long is a hang: the stuck worker is killed and
    replaced. Must exceed the slowest healthy step."""
    max_recoveries: int | None = None
    """Give up (``RecoveryError``) after this many recoveries; None: never."""
    checkpoint_every: int = 50
    """``restart`` only: write a checkpoint (torch.distributed.checkpoint) every this many steps."""
    checkpoint_dir: str | os.PathLike[str] | None = None
    """``restart`` only: where checkpoints go (default: the run folder, else a temp folder)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown recovery strategy {self.strategy!r}; choose one of {STRATEGIES}"
            )
        if (
            isinstance(self.hot_spares, bool)
            or not isinstance(self.hot_spares, int)
            or self.hot_spares < 0
        ):
            raise ValueError(f"hot_spares must be a non-negative integer, got {self.hot_spares!r}")
        if not (self.hang_timeout_s > 0 and math.isfinite(self.hang_timeout_s)):
            raise ValueError(
                f"hang_timeout_s must be a positive number of seconds, got {self.hang_timeout_s!r}"
            )
        if self.max_recoveries is not None and self.max_recoveries < 0:
            raise ValueError(f"max_recoveries must be >= 0 or None, got {self.max_recoveries!r}")
        if (
            isinstance(self.checkpoint_every, bool)
            or not isinstance(self.checkpoint_every, int)
            or self.checkpoint_every < 1
        ):
            raise ValueError(
                f"checkpoint_every must be a positive integer, got {self.checkpoint_every!r}"
            )
