"""What a convergence run produced: validation loss against simulated time, and its failures."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EvalRecord", "FailureEvent", "RunResult", "auto_target", "time_to_target"]


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """A validation loss at a committed step and a simulated time."""

    step: int
    time_s: float
    val_loss: float


@dataclass(frozen=True, kw_only=True)
class FailureEvent:
    """One attempted step in which stages failed, and what the strategy did."""

    attempt: int
    step: int
    """The step that was being attempted."""
    time_s: float
    """Simulated time at which the failure was handled."""
    stages: tuple[int, ...]
    action: str
    """A `Strategy` (``rollback``), the rebuild method per stage (``neighbor_average``,
    ``edge_copy``, ``copy``, ``random``, ``reinit``; several comma-separated), or
    ``failover`` (redundant computation)."""
    lost_steps: int
    """Committed steps undone (rollback), else 0."""
    seconds: float
    """Recovery cost charged, excluding the abandoned step."""


@dataclass(kw_only=True)
class RunResult:
    """One strategy's run: validation loss against simulated time, and its failures."""

    strategy: str
    rate: float
    seed: int
    steps: int
    step_s: float
    records: list[EvalRecord] = field(default_factory=list)
    events: list[FailureEvent] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    """Training loss per committed step of the final pass (exact replays: empty)."""
    total_time_s: float = 0.0
    attempts: int = 0
    derived: bool = False
    """True if the losses were taken from a no-failure baseline (see the Note)."""
    info: dict[str, Any] = field(default_factory=dict)

    def time_to(self, target: float) -> float | None:
        """`time_to_target` of this run."""
        return time_to_target(self.records, target)

    def final_loss(self) -> float:
        """The last recorded validation loss."""
        return self.records[-1].val_loss

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (`from_dict` reads it back)."""
        out = asdict(self)
        for event in out["events"]:
            event["stages"] = list(event["stages"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        """Read `to_dict`'s output."""
        data = dict(data)
        data["records"] = [EvalRecord(**r) for r in data.get("records", [])]
        data["events"] = [
            FailureEvent(**{**e, "stages": tuple(e["stages"])}) for e in data.get("events", [])
        ]
        return cls(**data)

    def dumps(self) -> str:
        """JSON text."""
        return json.dumps(self.to_dict())


def time_to_target(records: Sequence[EvalRecord], target: float) -> float | None:
    """Simulated time at which validation loss first reaches ``target``, or ``None``.

    Linear interpolation between the record just above the target and the first one at or
    below it (records in time order).
    """
    prev: EvalRecord | None = None
    for record in records:
        if record.val_loss <= target:
            if prev is None or prev.val_loss <= record.val_loss:
                return record.time_s
            frac = (prev.val_loss - target) / (prev.val_loss - record.val_loss)
            return prev.time_s + frac * (record.time_s - prev.time_s)
        prev = record
    return None


def auto_target(baseline: RunResult, fraction: float = 0.8) -> float:
    """The validation loss the no-failure ``baseline`` reaches at ``fraction`` of its steps.

    Taken at the last evaluation at or before that step.

    Raises:
        ValueError: if ``fraction`` is not in (0, 1] or the baseline has no records.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"target fraction must be in (0, 1], got {fraction!r}")
    if not baseline.records:
        raise ValueError("the baseline run has no evaluation records")
    limit = fraction * baseline.steps
    eligible = [r for r in baseline.records if r.step <= limit + 1e-9]
    return (eligible or baseline.records[:1])[-1].val_loss
