"""What a worker tells the controller: a step's report, where it runs, and whether an error
it saw means a peer died.

Plain data and one pure function: the runtime's bookkeeping (`recovery.runtime.detection`,
`ledger`, `membership`, `persistence`, `group`) reads them without needing the worker class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from parallelism.comm import CommError
from parallelism.engine import StepStats

__all__ = ["StepReport", "WorkerInfo", "is_comm_error"]


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure (a peer died or left, its bytes were
    garbled, this worker's groups were torn down) rather than an error of the user's code
    or the runtime's, which must stop the job, not trigger recovery.

    By type, never by what the message says ([Note: communication errors are marked at
    the source] in parallelism/errors.py): a `CommError` (a `GarbledMessage` included),
    marked by the call that talked to peers, or c10d's own ``DistError``, which only
    ``torch.distributed`` raises. A user's ``OSError("Connection reset")`` is the user's,
    as is every error a callback raises (`recovery.errors.CallbackError`).
    """
    return isinstance(exc, CommError | dist.DistError)


@dataclass
class StepReport:
    """A worker's answer to ``run_step``: ready (``ok``) with its measurements, or failed."""

    rank: int
    step: int
    ok: bool
    stats: StepStats = field(default_factory=StepStats)
    error: str = ""
    """For a failed step: the communication error the worker saw."""
    snapshots: dict[int, list[int]] = field(default_factory=dict)
    """Peer snapshots held: rank -> steps (its own rank: its own copies)."""
    durable_done: list[int] = field(default_factory=list)
    """Durable snapshot steps whose write finished since the last report."""
    durable_failed: dict[int, str] = field(default_factory=dict)
    """Durable snapshot steps whose write failed since the last report -> why (that
    snapshot is skipped)."""
    fingerprint: dict[str, str] | None = None
    """The state's fingerprint (`recovery.integrity.fingerprint`), on the steps the
    policy checks."""
    committed: bool = False
    """The workers decided the step and this one applied it (see [Note: workers decide the
    commit] in recovery/worker/stage.py)."""
    votes: dict[int, tuple[float, int, float]] = field(default_factory=dict)
    """Of a committed step: every worker's ``(loss_sum, losses, clipped gradient norm)``
    from the vote, by rank."""
    finished_at: float = 0.0
    """Of a committed step: when this worker had applied it (``time.time()``)."""
    batch: list[StepReport] = field(default_factory=list)
    """`StageWorker.run_steps`: the reports of the steps committed before this one in the
    same call."""
    held: bool = False
    """A failed report whose worker still holds the step's reduced gradients: the vote on
    it failed here and may have completed elsewhere, so the step may be committed yet."""
    skipped: bool = False
    """A failed report of a step sent ahead that the worker did not run (the step before
    was not committed here)."""


@dataclass(frozen=True)
class WorkerInfo:
    """Where a worker process runs."""

    pid: int
    node_id: str
    host: str
