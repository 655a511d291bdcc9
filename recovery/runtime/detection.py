"""Failure detection: await a step's reports, abort everyone at the first failure, find hangs.

[Note: failure detection]
A step's failure shows up in one of three ways, and `await_step` waits for all of them at
once: a dead worker's call gives `WorkerLost` (Ray, or the thread group, notices the
death); a survivor's call returns a failed `StepReport` (Gloo reported the dead peer, and
the survivor tore down its groups so that its own peers fail fast too -- see
``parallelism/comm/gloo_sockets.py``); or nothing returns within ``timeouts.hang``. In the last case
each silent worker is asked, on its control thread, what it is doing; those not blocked
on a peer are the hung ones, and they are killed, which turns the hang into the first
case. A hang is measured from a worker's last progress, not from the step's start: while
any worker is silent it is asked every ``PROBE_EVERY`` (a quarter of ``timeouts.hang``,
at most 5 s) how long ago it finished a schedule action, and only a worker idle for
``timeouts.hang`` counts -- so a long healthy step is never a hang, and a stuck one is
found within ``timeouts.hang`` (plus one probe interval) of its last progress. A worker
whose control thread does not answer within `probe_patience` -- a quarter of
``timeouts.hang``, at least 5 s -- is hung too (nothing in it runs), found a probe
interval plus that patience after it fell silent; so under the default 120 s a C call
that holds the GIL for 6 s in a long healthy step is not mistaken for a hang. Progress
and ``waiting_on`` mean the same on a GPU: an action counts once its CUDA work has
completed, and a wait queued on the GPU names its peer (``parallelism/progress.py``). A failure before the commit decision abandons the step everywhere; a worker that
dies after it (while applying the step) leaves the step committed for everyone else, and
its replacement copies the committed state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from recovery.groups.group import Call, CallResults, WorkerGroup, WorkerLost, seconds
from recovery.names import FailureCause
from recovery.runtime.records import Failure
from recovery.worker import StageWorker, StepReport

__all__ = [
    "PROBE_PATIENCE_FLOOR",
    "StepOutcome",
    "abort_pending",
    "await_step",
    "failure_of",
    "non_finite",
    "probe_patience",
    "settle",
]

log = logging.getLogger("checkfree")

PROBE_PATIENCE_FLOOR = timedelta(seconds=5)
"""The least time a silent worker's control thread has to say what it is doing (the
patience under a short hang timeout; `probe_patience`)."""


def probe_patience(hang_timeout: timedelta | float) -> float:
    """Seconds a silent worker's control thread has to answer a probe before the worker
    counts as hung: a quarter of the hang timeout, at least `PROBE_PATIENCE_FLOOR` (a
    probe that waits this long holds the controller's loop as long, hence not all of it)."""
    return max(PROBE_PATIENCE_FLOOR.total_seconds(), seconds(hang_timeout) / 4)


@dataclass
class StepOutcome:
    """What a step (or an evaluation) gave, per worker."""

    reports: dict[int, StepReport] = field(default_factory=dict)
    """Every report that came back, ok or failed."""
    lost: dict[int, WorkerLost] = field(default_factory=dict)
    """Workers that died (or were killed as hung) during the step."""
    hung: set[int] = field(default_factory=set)
    """Workers killed because they made no progress."""

    @property
    def failed(self) -> dict[int, str]:
        """Survivors that reported a communication error, with what they saw."""
        return {rank: r.error for rank, r in self.reports.items() if not r.ok}

    @property
    def ok(self) -> bool:
        return not self.lost and not self.failed


def await_step(
    group: WorkerGroup,
    calls: Mapping[int, Call],
    hang_timeout: timedelta | float,
    generation: int | None = None,
) -> StepOutcome:
    """Wait for a step's reports; abort the rest at the first failure; kill hung workers
    (see [Note: failure detection]). ``generation``: the one the step runs in (an abort
    that reaches a worker only once it is in a newer one is ignored there).

    Raises:
        Exception: the original error of a worker whose own code raised.
    """
    hang_s = seconds(hang_timeout)
    every = min(max(hang_s / 4, 0.05), 5.0)
    abort = abort_pending(group, generation)
    waiting = list(calls.values())
    failed_at: float | None = None
    hung: set[int] = set()
    while waiting:
        finished, waiting = group.wait(waiting, every, first=True)
        if finished:
            if failed_at is None and not all(_succeeded(group, call) for call in finished):
                failed_at = time.monotonic()
                abort(waiting)
            continue
        if failed_at is not None:  # aborted: the rest leave at once, or are given up on
            if time.monotonic() - failed_at > min(60.0, hang_s):
                hung = {rank for rank, call in calls.items() if call in waiting}
                break
            continue
        hung = _find_hung(group, [rank for rank, call in calls.items() if call in waiting], hang_s)
        if hung:
            break
    if hung:
        for rank in sorted(hung):
            log.warning(
                "worker rank %d made no progress for %.0f s: killing it",
                rank,
                seconds(hang_timeout),
            )
        group.kill(hung)
        # Their victims are told to leave: Gloo would wake them (the dead peer's sockets
        # close), NCCL would not -- a GPU waiting on a dead peer waits until aborted.
        abort([call for rank, call in calls.items() if call in waiting and rank not in hung])
        _, still = group.wait(list(calls.values()), min(60.0, seconds(hang_timeout)))
        late = {rank for rank, call in calls.items() if call in still}
        hung |= late  # still silent after the cascade: give up on them too
        group.kill(late)
    gathered = group.gather(dict(calls), timedelta(seconds=10))
    reports = dict(gathered.results)
    for rank, (_, error) in gathered.broken.items():  # a survivor whose groups broke
        reports[rank] = StepReport(rank=rank, step=-1, ok=False, error=error)
    return StepOutcome(reports=reports, lost=gathered.lost, hung=hung)


def settle(
    group: WorkerGroup,
    calls: Mapping[Any, Call],
    timeout: timedelta | float,
    *,
    on_failure: Callable[[list[Call]], None] | None = None,
    generation: int | None = None,
) -> CallResults:
    """Wait for ``calls`` that depend on each other (transfers, group formation); at the
    first one that fails, run ``on_failure`` on those still pending (default: tell their
    workers to abort ``generation``'s work) so that nobody waits on a peer that will
    never answer.

    Raises:
        Exception: the original error of a worker whose own code raised (not a
            communication error, see `WorkerGroup.gather`).
    """
    abort = on_failure or abort_pending(group, generation)
    _wait_or_abort(group, calls, timeout, _returned, abort)
    return group.gather(calls, timeout=0)


def _wait_or_abort(
    group: WorkerGroup,
    calls: Mapping[Any, Call],
    timeout: timedelta | float,
    succeeded: Callable[[WorkerGroup, Call], bool],
    on_failure: Callable[[list[Call]], None],
) -> list[Call]:
    """Wait for every call; at the first sign of failure, run ``on_failure`` on the rest.

    For a step, that tells the rest to abort it: without the abort, a survivor that is not
    connected to the dead worker would only notice when the failure reaches it through
    the schedule -- e.g. a whole healthy pipeline computing on until the gradient
    all-reduce. Returns the calls not finished.
    """
    waiting = list(calls.values())
    deadline = time.monotonic() + seconds(timeout)
    failed = False
    while waiting:
        finished, waiting = group.wait(waiting, max(0.0, deadline - time.monotonic()), first=True)
        if not finished:
            break
        if not failed and not all(succeeded(group, call) for call in finished):
            failed = True
            on_failure(waiting)
    return waiting


def abort_pending(
    group: WorkerGroup, generation: int | None = None
) -> Callable[[list[Call]], None]:
    """What tells the workers of pending calls to abort (each once, on its control thread;
    ``generation``: the one whose work is given up, formation included; None: whatever
    the worker runs)."""

    def abort(pending: list[Call]) -> None:
        for rank in dict.fromkeys(call.rank for call in pending):
            group.submit(rank, StageWorker.abort, generation, group.job)

    return abort


def _succeeded(group: WorkerGroup, call: Call) -> bool:
    """Whether a finished step call returned a successful report."""
    try:
        return bool(group.result(call).ok)
    except Exception:
        return False


def _returned(group: WorkerGroup, call: Call) -> bool:
    """Whether a finished call returned (rather than raised or lost its worker)."""
    try:
        group.result(call)
        return True
    except Exception:
        return False


def _find_hung(group: WorkerGroup, silent: list[int], hang_s: float) -> set[int]:
    """Among silent workers, those idle for ``hang_s`` and not blocked on a peer; all of the
    idle ones if each waits on another (none stands out); none while any progresses. A
    worker whose control thread does not answer within `probe_patience` is hung."""
    probes = {rank: group.submit(rank, StageWorker.probe) for rank in silent}
    answers = group.gather(probes, probe_patience(hang_s))
    idle = {rank for rank, a in answers.results.items() if a.get("idle_s", 0.0) >= hang_s}
    culprits = {rank for rank in idle if answers.results[rank].get("waiting_on") is None}
    if culprits or answers.lost:
        return culprits | set(answers.lost)
    return idle if idle == set(answers.results) else set()


def non_finite(reports: Mapping[int, StepReport]) -> dict[int, str]:
    """Workers whose loss or gradient norm is NaN or infinite, with what was seen."""
    bad = {}
    for rank, r in reports.items():
        if not r.stats.finite:
            bad[rank] = f"non-finite loss {r.stats.loss_sum} or gradient norm {r.stats.grad_norm}"
    return bad


def failure_of(
    step: int,
    outcome: StepOutcome,
    *,
    numerical: Mapping[int, str] | None,
    node_lost: bool,
    struck_at: float,
    generation: int,
) -> Failure:
    """The `Failure` a failed step (or evaluation) is recovered from: who was lost, what
    each worker saw, and the cause, most specific first."""
    messages = {rank: f"{type(e).__name__}: {e.reason}" for rank, e in outcome.lost.items()}
    messages.update(numerical or outcome.failed)
    if numerical:
        cause = FailureCause.NUMERICAL
    elif outcome.hung:
        cause = FailureCause.HUNG
    elif node_lost:
        cause = FailureCause.NODE_LOST
    elif outcome.lost:
        cause = FailureCause.KILLED
    else:
        cause = FailureCause.COMMUNICATION
    return Failure(
        step=step,
        lost=set(outcome.lost),
        cause=cause,
        detected_at=time.time(),
        struck_at=struck_at,
        errors=messages,
        generation=generation,
        numerical=bool(numerical),
    )
