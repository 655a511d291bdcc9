"""What the controller records: a committed step (`StepRecord`), a detected failure
(`Failure`), and the `RecoveryEvent` it becomes once the job trains again."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from parallelism.topology import Topology
from recovery.errors import RecoveryInterrupted
from recovery.events import RecoveryEvent
from recovery.integrity.fingerprint_vote import Verdict
from recovery.names import FailureCause
from recovery.planner import RecoveryPlan
from recovery.worker import StepReport

__all__ = ["Failure", "PendingEvent", "StepRecord", "recovery_event", "step_record"]


@dataclass
class StepRecord:
    """What the controller records for one committed step."""

    step: int
    loss: float
    time: float
    step_s: float
    tokens_per_s: float
    generation: int
    grad_norms: list[float]
    bubble: float
    """Pipeline idle fraction: 1 - compute seconds / schedule seconds, over all workers."""
    val_loss: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def step_record(
    topology: Topology,
    step: int,
    reports: Mapping[int, StepReport],
    *,
    elapsed: float,
    since_start: float,
    tokens_per_step: int,
    generation: int,
) -> StepRecord:
    """The record of a committed step, from every worker's report (the loss and the
    gradient norms: from the workers' vote, if they decided the step -- it has those of a
    worker that died applying it)."""
    votes = next((r.votes for r in reports.values() if r.votes), None)
    if votes is not None:
        ranks = sorted(votes)
        loss_sum = sum(votes[rank][0] for rank in ranks)
        count = sum(votes[rank][1] for rank in ranks)
        norms = [votes[topology.stage_group(s)[0]][2] for s in range(topology.stages)]
    else:
        loss_sum = sum(r.stats.loss_sum for r in reports.values())
        count = sum(r.stats.losses for r in reports.values())
        # Any replica's norm (they are equal); the first present one (a shrink may lack some).
        norms = [
            next(
                reports[r] for r in topology.stage_group(s) if r in reports
            ).stats.clipped_grad_norm
            for s in range(topology.stages)
        ]
    busy = sum(r.stats.compute_s for r in reports.values())
    span = sum(r.stats.schedule_s for r in reports.values())
    return StepRecord(
        step=step,
        loss=loss_sum / count if count else math.nan,
        time=since_start,
        step_s=elapsed,
        tokens_per_s=tokens_per_step / elapsed if elapsed > 0 else 0.0,
        generation=generation,
        grad_norms=norms,
        bubble=1.0 - busy / span if span > 0 else 0.0,
    )


@dataclass
class Failure:
    """A failed step, as detected."""

    step: int
    lost: set[int]
    cause: FailureCause
    detected_at: float
    struck_at: float
    errors: dict[int, str]
    generation: int
    numerical: bool = False
    """A non-finite loss or gradient norm: the live state itself is suspect."""
    suspect: bool = False
    """An interrupted restore overwrote part of some survivors' live state: roll back."""
    corruption: Verdict | None = None
    """A fingerprint mismatch (cause ``corrupted``): what the vote found."""
    interruptions: list[str] = field(default_factory=list)
    """What went wrong during the recovery so far (see [Note: re-entrant recovery])."""
    blanks: set[int] = field(default_factory=set)
    """Lost ranks whose worker is a live replacement that holds nothing yet (the recovery
    that started it was interrupted): its process is kept and set up afresh, not killed
    and started again (see [Note: live workers are kept])."""
    deaths: collections.Counter[int] = field(default_factory=collections.Counter)
    """Per rank, how many of its workers died during the recovery."""
    quiet: int = 0
    """Interruptions in a row in which no worker died (calls broke with everyone alive)."""
    slow: dict[int, float] = field(default_factory=dict)
    """Cause ``straggler``: each straggler's compute time over its stage's other replicas'
    median (recovery/runtime/stragglers.py)."""

    def interrupt(
        self,
        phase: str,
        error: RecoveryInterrupted,
        *,
        rebuilding: set[int],
        survivors_restored: bool,
    ) -> None:
        """A failure during the recovery: ``error``'s losses and every rank the recovery was
        rebuilding are lost now -- those of them whose new worker still lives are blanks --
        and survivors a restore wrote to make the state suspect. ``error``'s broken ranks
        (alive, their call failed because a peer died) are not lost."""
        self.lost |= error.lost | rebuilding
        self.deaths.update(error.lost)
        self.quiet = 0 if error.lost else self.quiet + 1
        self.blanks = (self.blanks | rebuilding) - error.lost
        self.errors.update({r: f"during recovery: {error}" for r in error.lost | error.broken})
        self.suspect |= survivors_restored
        self.interruptions.append(f"{phase}: {error}")

    def hopeless(self, limit: int, topology: Topology) -> str | None:
        """Why the recovery should stop retrying, or None: some rank's new workers died
        ``limit`` times (a place where no worker survives: a broken node or environment), or
        ``limit`` interruptions in a row lost nobody (the calls themselves keep failing).
        Deaths spread over many ranks do not count against it: each takes real redundancy,
        and the planner says when there is none left."""
        if self.deaths:
            rank, died = self.deaths.most_common(1)[0]
            if died >= limit:
                return f"worker {topology.worker(rank)}'s new workers died {died} times"
        if self.quiet >= limit:
            return f"{self.quiet} interruptions in a row with every worker alive"
        return None

    def describe(self, topology: Topology) -> str:
        lines = [f"step {self.step} failed in generation {self.generation} ({self.cause}):"]
        for rank, error in sorted(self.errors.items()):
            first = error.splitlines()[0][:300] if error else ""
            lines.append(f"  worker {topology.worker(rank)} (rank {rank}): {first}")
        return "\n".join(lines)


@dataclass
class PendingEvent:
    """A finished recovery whose event waits for the first commit after it (``resume``)."""

    event: RecoveryEvent
    recovered_at: float = field(default_factory=time.time)

    def close(self, *, resumed: bool) -> RecoveryEvent:
        """The complete event; ``resumed=False``: the job ended with the recovery."""
        self.event.breakdown["resume"] = time.time() - self.recovered_at if resumed else 0.0
        self.event.seconds = sum(self.event.breakdown.values())
        return self.event


def recovery_event(
    topology: Topology,
    failure: Failure,
    plan: RecoveryPlan,
    *,
    lost: Collection[int],
    warm: Collection[int],
    moved: int,
    generation: int,
    started_wall: float,
    breakdown: Mapping[str, float],
    embedding: dict[str, float] | None,
    transfers_corrupted: Collection[tuple[int, int, tuple[str, ...], int | None]] = (),
) -> RecoveryEvent:
    """The event of a finished recovery (its ``resume`` phase is added at the next commit).

    ``transfers_corrupted``: what arrived corrupted meanwhile and was not used, as
    ``(target, source, tensors, snapshot step or None)`` (`RedundancyLedger.corrupted`).
    """

    def coords(rank: int) -> tuple[int, int]:
        worker = topology.worker(rank)
        return (worker.stage, worker.replica)

    return RecoveryEvent(
        step=failure.step,
        generation=generation,
        cause=failure.cause,
        lost=[coords(r) for r in sorted(lost)],
        strategy=plan.strategy,
        actions=[
            {
                "worker": coords(a.rank),
                "strategy": a.strategy,
                "sources": [coords(s) for s in a.sources],
                "warm": a.rank in warm,
            }
            for a in plan.actions
        ],
        bytes_moved=moved,
        lost_steps=failure.step - plan.resume_step,
        time=failure.struck_at - started_wall,
        tier=plan.tier,
        breakdown={"detect": max(0.0, failure.detected_at - failure.struck_at), **breakdown},
        detail=failure.describe(topology) + "\n" + plan.describe(topology),
        interruptions=list(failure.interruptions),
        embedding=embedding,
        corrupted=[]
        if failure.corruption is None
        else [
            {
                "worker": coords(r),
                "tensors": list(failure.corruption.tensors.get(r, ())),
                "majority": r not in failure.corruption.undecided,
            }
            for r in sorted(failure.corruption.suspects + failure.corruption.undecided)
        ],
        stragglers=[
            {"worker": coords(rank), "ratio": round(ratio, 3)}
            for rank, ratio in sorted(failure.slow.items())
        ],
        transfers_corrupted=[
            {
                "target": coords(target),
                "source": coords(source),
                "tensors": list(tensors),
                "snapshot": snapshot,
            }
            for target, source, tensors, snapshot in transfers_corrupted
        ],
    )
