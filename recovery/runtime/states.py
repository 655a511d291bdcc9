"""The controller's states: one class per phase, carrying what that phase works on.

A transition of the controller (recovery/runtime/controller.py) takes the state it is in
and returns the next one, so what a phase needs is in its state and nowhere else: a
`Recovering` state holds the failure it recovers from, `Replacing`, `Reforming` and
`Restoring` the `Recovery` under way (the failure, who survives, the plan), `Errored`
the error that ended the job. (After Ray Train v2's controller states.)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import ClassVar

from recovery.errors import RecoveryError
from recovery.planner import RecoveryPlan
from recovery.runtime.records import Failure

__all__ = [
    "IN_RECOVERY",
    "Errored",
    "Finished",
    "Phase",
    "Recovering",
    "Recovery",
    "Reforming",
    "Replacing",
    "Restoring",
    "Running",
    "Starting",
    "State",
    "Underway",
    "failure_in",
    "rebuilding_in",
]


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    REPLACING = "replacing"
    REFORMING = "reforming"
    RESTORING = "restoring"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class Recovery:
    """A recovery in progress, carried from phase to phase."""

    failure: Failure
    lost: set[int]
    alive: dict[int, int]
    """Each survivor's committed step."""
    assessed: dict[int, dict[str, int]]
    plan: RecoveryPlan
    """The planner's decision (remade on a fallback)."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (summed over the attempts of an interrupted recovery)."""
    warm: set[int] = field(default_factory=set)
    blanks: set[int] = field(default_factory=set)
    """Lost ranks whose live worker holds nothing yet: set up afresh, not started again."""
    ring_before: dict[int, int] = field(default_factory=dict)

    def restores_survivors(self) -> bool:
        """Whether the plan writes to live workers too (a rollback), not only to the lost."""
        return any(action.rank not in self.lost for action in self.plan.actions)

    def add_time(self, phase: str, since: float) -> None:
        self.breakdown[phase] = self.breakdown.get(phase, 0.0) + time.perf_counter() - since


@dataclass
class State:
    phase: ClassVar[Phase]


@dataclass
class Starting(State):
    phase = Phase.STARTING


@dataclass
class Running(State):
    phase = Phase.RUNNING


@dataclass
class Recovering(State):
    """Survivors leave, the planner decides."""

    phase = Phase.RECOVERING
    failure: Failure
    carried: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the attempts before (an interrupted recovery)."""


@dataclass
class Underway(State):
    """A recovery past its plan."""

    recovery: Recovery


@dataclass
class Replacing(Underway):
    """Workers for the lost ranks."""

    phase = Phase.REPLACING


@dataclass
class Reforming(Underway):
    """The next generation's process groups."""

    phase = Phase.REFORMING


@dataclass
class Restoring(Underway):
    """The plan's transfers, the mirrors re-seeded."""

    phase = Phase.RESTORING


@dataclass
class Finished(State):
    phase = Phase.FINISHED


@dataclass
class Errored(State):
    phase = Phase.FAILED
    error: RecoveryError


IN_RECOVERY = (Recovering, Replacing, Reforming, Restoring)


def failure_in(state: State) -> Failure | None:
    """The failure ``state`` recovers from (None outside a recovery)."""
    if isinstance(state, Recovering):
        return state.failure
    if isinstance(state, Underway):
        return state.recovery.failure
    return None


def rebuilding_in(state: State) -> set[int]:
    """The ranks a recovery in ``state`` is rebuilding: the failure's lost, and those
    the plan under way rebuilds."""
    failure = failure_in(state)
    out = set(failure.lost) if failure is not None else set()
    if isinstance(state, Underway):
        out |= state.recovery.lost
    return out
