"""What the controller does next, decided by pure functions of what it knows.

Each function takes plain values and returns an enum (with a delay where one waits), so
that the rules are read and tested here, without workers, Ray or time
(tests/test_decisions.py): when a step boundary finishes, grows or steps; whether a
communication error with everyone alive is retried or ends the job, and after how long;
whether an interrupted recovery plans again; whether a recovery replaces its lost
workers or shrinks without them. The controller (recovery/runtime/controller.py) carries
out what they return and decides nothing itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "COMM_BACKOFF_S",
    "MAX_COMM_BACKOFF_S",
    "MAX_INTERRUPTIONS",
    "AtBoundary",
    "OnCommError",
    "OnFailure",
    "Replace",
    "Retry",
    "at_boundary",
    "on_comm_error",
    "on_failure",
    "on_interruption",
    "replacement",
]

MAX_INTERRUPTIONS = 8
"""Deaths of one rank's workers, or interruptions in a row that lose nobody, during one
recovery before the job gives up (`Failure.hopeless`; see [Note: re-entrant recovery] in
recovery/runtime/controller.py)."""
COMM_BACKOFF_S = 0.25
"""The wait before the first retry of a step that failed with nobody lost; it doubles."""
MAX_COMM_BACKOFF_S = 8.0


class AtBoundary(enum.Enum):
    """What RUNNING does at a step boundary."""

    STEP = "step"
    """Run the next steps."""
    GROW = "grow"
    """Bring back missing workers whose spares are ready (see [Note: elastic shrink])."""
    STRAGGLER = "straggler"
    """Replace the workers found slower than their stage's other replicas (see [Note:
    stragglers] in recovery/runtime/stragglers.py)."""
    FINISH = "finish"
    """Every step is committed."""


def at_boundary(
    step: int, target: int, *, missing: bool, spares_ready: bool, stragglers: bool = False
) -> AtBoundary:
    """``step``: the next step to run; ``missing``: a shrink left workers out;
    ``spares_ready``: a spare is ready for one of them; ``stragglers``: some workers were
    found slow (a job at its last step finishes instead: replacing them gains nothing)."""
    if step >= target:
        return AtBoundary.FINISH
    if missing and spares_ready:
        return AtBoundary.GROW
    if stragglers:
        return AtBoundary.STRAGGLER
    return AtBoundary.STEP


class OnFailure(enum.Enum):
    """Whether a failure is recovered from."""

    RECOVER = "recover"
    GIVE_UP = "give up"


def on_failure(recoveries: int, max_recoveries: int | None) -> OnFailure:
    """A new failure after ``recoveries`` recoveries: give up once ``max_recoveries`` (the
    policy's cap; None: none) were made."""
    if max_recoveries is not None and recoveries >= max_recoveries:
        return OnFailure.GIVE_UP
    return OnFailure.RECOVER


class Retry(enum.Enum):
    RETRY = "retry"
    GIVE_UP = "give up"


@dataclass(frozen=True)
class OnCommError:
    """What to do about a communication error with every worker alive."""

    decision: Retry
    delay_s: float = 0.0
    """How long to wait before the retry."""


def on_comm_error(in_a_row: int, retries: int) -> OnCommError:
    """The ``in_a_row``-th communication error with every worker alive and no commit in
    between: retry after a wait that doubles from `COMM_BACKOFF_S` up to
    `MAX_COMM_BACKOFF_S`, or give up past ``retries`` (see [Note: communication errors
    with nobody lost] in recovery/runtime/controller.py)."""
    assert in_a_row >= 1, in_a_row
    if in_a_row > retries:
        return OnCommError(Retry.GIVE_UP)
    return OnCommError(Retry.RETRY, min(COMM_BACKOFF_S * 2 ** (in_a_row - 1), MAX_COMM_BACKOFF_S))


def on_interruption(hopeless: str | None) -> Retry:
    """A failure during a recovery: plan again, unless the failure's record says retrying
    cannot help (``hopeless``: why, from `Failure.hopeless`)."""
    return Retry.GIVE_UP if hopeless is not None else Retry.RETRY


class Replace(enum.Enum):
    """How a recovery brings back the workers it lost."""

    START = "start"
    """Start (or set up afresh) a worker for every lost rank, waiting for each."""
    SHRINK = "shrink"
    """Bring back those with a warm spare and train on without the others (elastic)."""
    GIVE_UP = "give up"


def replacement(
    *, elastic: bool, shrinkable: bool, cold: bool, to_start: bool, no_room: bool = False
) -> Replace:
    """``to_start``: some lost ranks need a new worker; ``no_room``: starting them failed
    for want of room; ``cold``: the restart baseline (everyone comes back cold, never
    shrinks). An elastic job shrinks rather than stall everyone on a cold start (see
    [Note: elastic shrink] in recovery/runtime/elastic.py)."""
    may_shrink = elastic and shrinkable and not cold
    if no_room:
        return Replace.SHRINK if may_shrink else Replace.GIVE_UP
    return Replace.SHRINK if to_start and may_shrink else Replace.START
