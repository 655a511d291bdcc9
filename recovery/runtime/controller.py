"""The controller: a small phase machine that drives one job over a `WorkerGroup`.

It runs in the driver process (the one that calls `Trainer.fit`), never on a worker, so
losing any worker never loses the store or the job's bookkeeping. `advance` performs
exactly one transition, which is what tests drive (over a `ThreadWorkerGroup`, no Ray):

    STARTING --start()--> RUNNING --step ok--> RUNNING --all steps--> FINISHED
                             |  ^
                     failure |  | RESTORING: the plan's transfers, mirrors re-seeded
                             v  |
                        RECOVERING: survivors leave, the planner decides
                             |
                        REPLACING: new workers for the lost ranks
                             |
                        REFORMING: the next generation's process groups --> RESTORING
                        (any phase, no way out) --> FAILED

[Note: re-entrant recovery]
A worker can die (or a survivor's groups break) while a recovery is under way: while a
replacement starts, while groups form, while state moves -- the source of a transfer
included. Every recovery phase reports that as `RecoveryInterrupted` (never a raw
Ray/Gloo/store error), and `advance` goes back to RECOVERING with the failure's lost set
grown by the new losses and by every rank the interrupted recovery was rebuilding (their
new workers hold nothing trustworthy yet). Planning then runs on what really survives,
exactly as if the failures had been spaced out; survivors' states are untouched by a
recovery except by a rollback's load, so an interrupted rollback marks the failure
`suspect` and the next plan rolls everyone back. When the redundancy is gone the planner
says so (`RedundancyExhausted`). The job gives up only where retrying cannot help: one
rank's new workers died `MAX_INTERRUPTIONS` times (nothing survives in that place), or as
many interruptions in a row lost nobody. Deaths spread over the job do not count against
it -- a burst of outside kills faster than a cold recovery interrupts it again and again,
and it goes on while a replica of every stage lives.

[Note: live workers are kept]
A worker is lost only when it is dead, hung past the hang timeout, or outvoted by its
replicas: only then is its state thrown away. A live worker whose call failed because a
peer died -- a step, a formation, a transfer -- is *broken*: its process groups are
unusable, its state is not, and it leaves the generation with the others and joins the
next one as it is. A replacement started by a recovery that is then interrupted is lost
in the other sense -- it holds nothing trustworthy yet -- but its process lives: it is
kept as a *blank* (`Failure.blanks`) and set up afresh in the next attempt
(`Membership.renew`, milliseconds) instead of being killed and started again (a cold
start: seconds, during which more workers can die). A formation that cannot complete is
given up by number (``abort(generation)``), so that a joiner the abort overtook does not
wait the join timeout for a peer that is gone. So a burst of deaths costs each replacement
one cold start at most, and the job survives any sequence of failures that leaves a live
replica of every stage (or, for a stage with none, a snapshot of one of its replicas).

[Note: communication errors with nobody lost]
A step can fail with a communication error while every worker is alive (a flaky link, a
peer that was slow to accept): nobody is rebuilt, the generation is re-formed and the step
retried. That is bounded: before each retry the controller waits (`COMM_BACKOFF_S`,
doubling, at most `MAX_COMM_BACKOFF_S`), and after `RecoveryPolicy.comm_retries` such
failures in a row -- with no step committed in between -- it gives up with a
`RecoveryError` naming each worker and the error it saw, rather than retrying forever.
A failure in which some worker was lost is an ordinary recovery and resets nothing.

What each part does lives elsewhere: detection (recovery/runtime/detection.py), injected
faults (injection.py), placement, spares and generations (membership.py), the redundancy
that exists (ledger.py), snapshots and checkpoints (persistence.py), the plan's transfers
(executor.py), what differs per kind of state (layouts.py). The controller decides
nothing the planner did not decide.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from parallelism.devices import Backend, Device
from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.errors import (
    PlacementFailed,
    RecoveryError,
    RecoveryInterrupted,
    RedundancyExhausted,
)
from recovery.events import RecoveryEvent
from recovery.faults import FailureSchedule
from recovery.names import Strategy
from recovery.planner import RecoveryPlan, plan
from recovery.policy import RecoveryPolicy
from recovery.runtime.detection import (
    StepOutcome,
    abort_pending,
    await_step,
    failure_of,
    non_finite,
)
from recovery.runtime.elastic import grow_plan, shrink_plan, shrinkable
from recovery.runtime.executor import execute_or_fall_back
from recovery.runtime.group import Call, WorkerGroup, WorkerLost
from recovery.runtime.injection import Armed, InjectedFaults, fault_time
from recovery.runtime.layouts import StateLayout, layout_for
from recovery.runtime.ledger import RedundancyLedger
from recovery.runtime.membership import Membership
from recovery.runtime.persistence import Persistence
from recovery.runtime.records import (
    Failure,
    PendingEvent,
    StepRecord,
    recovery_event,
    step_record,
)
from recovery.vote import Verdict, can_vote, corruption_plan, vote
from recovery.worker import StepReport, WorkerInfo

__all__ = ["MAX_INTERRUPTIONS", "Controller", "ControllerConfig", "Phase"]

log = logging.getLogger("checkfree")

_GROW = "grow"
"""The cause of a grow's `Failure` (nothing failed: the missing workers' spares are ready)."""
MAX_INTERRUPTIONS = 8
"""Deaths of one rank's workers, or interruptions in a row that lose nobody, during one
recovery before the job gives up (`Failure.hopeless`; see [Note: re-entrant recovery])."""
COMM_BACKOFF_S = 0.25
"""The wait before the first retry of a step that failed with nobody lost; it doubles."""
MAX_COMM_BACKOFF_S = 8.0
BATCH_STEPS = 16
"""The most steps the workers run in one call (see [Note: batched steps])."""
BATCH_S = 0.25
"""About how long a call of several steps lasts at most (see [Note: batched steps])."""


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    REPLACING = "replacing"
    REFORMING = "reforming"
    RESTORING = "restoring"
    FINISHED = "finished"
    FAILED = "failed"


_IN_RECOVERY = (Phase.RECOVERING, Phase.REPLACING, Phase.REFORMING, Phase.RESTORING)


@dataclass
class ControllerConfig:
    """How the controller runs the job (set by `Trainer`, which checks every value)."""

    backend: Backend
    """The workers' process groups: ``"gloo"`` or ``"nccl"``."""
    device: Device | None = None
    """The workers' compute device, ``"cpu"`` or ``"cuda"`` (parallelism/devices.py); None:
    the backend's own."""
    threads_per_worker: int = 1
    """Torch intra-op threads per worker."""
    eval_every: int = 0
    """Held-out loss every this many steps (0: never)."""
    eval_batches: int = 1
    """Held-out batches per evaluation."""
    work_dir: str | None = None
    """Where the restart baseline writes checkpoints (default: a temp folder)."""
    snapshot_dir: str | None = None
    """Where durable snapshots go (required when the policy sets ``snapshots.durable_every``)."""
    resume: bool = True
    """Resume from the newest intact durable snapshot in ``snapshot_dir``, if one exists."""
    worker_options: dict[str, Any] = field(default_factory=dict)
    """Extra Ray actor options for every worker (`RayWorkerGroup` only)."""
    worker_resources: dict[str, float] | None = None
    """What each worker and hot spare asks Ray for (`Trainer(worker_resources=...)`; see
    recovery/resources.py); None: the default. `RayWorkerGroup` only."""


@dataclass
class _Recovery:
    """A recovery in progress, carried from phase to phase."""

    failure: Failure
    lost: set[int]
    alive: dict[int, int]
    assessed: dict[int, dict[str, int]]
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (summed over the attempts of an interrupted recovery)."""
    plan: RecoveryPlan = field(init=False)
    """The planner's decision (made once the survivors are known; remade on a fallback)."""
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
class _PendingCommit:
    """A step whose commit was sent and not yet waited for (see [Note: pipelined commit])."""

    calls: dict[int, Call]
    struck_at: float
    faults: Armed


def _ray_group(layout: StateLayout, config: ControllerConfig) -> WorkerGroup:
    """The default group: Ray actors (Ray is imported only when it is used)."""
    from recovery.runtime.ray_group import RayWorkerGroup

    return RayWorkerGroup.connect(
        layout.worker_cls,
        threads=config.threads_per_worker,
        backend=config.backend,
        device=config.device,
        resources=config.worker_resources,
        options=config.worker_options,
    )


class Controller:
    """Drives one training job. See the module docstring for the phase machine.

    Args:
        group: the workers' `WorkerGroup`; default: a `RayWorkerGroup` (Ray is connected
            to, or started, in `start`).
    """

    def __init__(
        self,
        spec: TrainSpec,
        topology: Topology,
        config: ControllerConfig,
        *,
        policy: RecoveryPolicy | None = None,
        failures: FailureSchedule | None = None,
        group: WorkerGroup | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        on_event: Callable[[RecoveryEvent], None] | None = None,
    ) -> None:
        self.spec = spec
        self.topology = topology
        self.config = config
        self.policy = policy or RecoveryPolicy()
        self.faults = InjectedFaults(failures or FailureSchedule(), topology)
        self.group = group
        self.on_step = on_step or (lambda record: None)
        self.on_event = on_event or (lambda event: None)
        self.phase = Phase.STARTING
        self.step = 0
        self.target_steps = 0
        self.records: list[StepRecord] = []
        self.events: list[RecoveryEvent] = []
        self.error: BaseException | None = None
        self.started_at = time.perf_counter()
        self.started_wall = time.time()
        self.resumed_from: int | None = None
        self.ledger = RedundancyLedger(topology)
        self.verified = 0
        """The newest step whose fingerprints agreed in every stage group (see [Note:
        fingerprint vote] in recovery/vote.py): no worker's state was corrupted then."""
        self._failure: Failure | None = None
        self._recovery: _Recovery | None = None
        self._carried: dict[str, float] = {}
        self._comm_errors = 0
        """Communication errors with nobody lost since the last commit (see [Note:
        communication errors with nobody lost])."""
        self._pending_event: PendingEvent | None = None
        self._restock = False
        """Spares were taken by a recovery: start new ones once training is back (see
        [Note: restocking spares after the first step])."""
        self._pending_commit: _PendingCommit | None = None
        self._ahead: tuple[int, int, dict[int, Call]] | None = None
        """Steps sent before the ones running were settled: the first, how many, and the
        calls (see [Note: pipelined commit])."""
        self.tokens_per_step = 0
        self.layout: StateLayout
        self.members: Membership
        self.persistence: Persistence

    # -- views ---------------------------------------------------------------------------

    def infos(self) -> dict[int, WorkerInfo]:
        """Where each live worker runs."""
        assert self.group is not None
        return {rank: self.group.info(rank) for rank in self.group.ranks()}

    def rebuilding(self) -> set[int]:
        """The ranks whose worker holds no trustworthy state now: those a failure found
        lost and a recovery under way is rebuilding, and those a shrink left out. (Read
        from another thread: a snapshot, not a promise.)"""
        failure, rec = self._failure, self._recovery
        out = set(failure.lost) if failure is not None else set()
        if rec is not None:
            out |= rec.lost
        if hasattr(self, "members"):
            out |= self.members.missing
        return out

    @property
    def generation(self) -> int:
        """The process groups' generation (0 from `start`; one more per re-formation)."""
        return self.members.generation if hasattr(self, "members") else -1

    # -- startup -------------------------------------------------------------------------

    def start(self) -> None:
        """Validate, host the store, start and set up every worker, form generation 0.

        Raises:
            ValueError: for a spec, policy and backend that do not combine (before any
                worker starts).
            RecoveryError: if workers cannot be started or set up.
        """
        assert self.phase is Phase.STARTING
        self.tokens_per_step = self.spec.check(self.topology)
        self.layout = layout_for(self.spec, self.topology, self.policy, self.tokens_per_step)
        self.layout.validate(self.config.backend, self.config.device)
        self.group = self.group or _ray_group(self.layout, self.config)
        self.group.check_capacity(self.topology.world_size + self.policy.hot_spares)
        self.members = Membership(
            self.group,
            self.spec,
            self.topology,
            self.policy,
            self.layout,
            self.ledger,
            host=self.group.store_host(),
            backend=self.config.backend,
            device=self.config.device,
        )
        self.faults.check_nodes(len(self.members.job_nodes))
        self.persistence = Persistence(
            self.group,
            self.spec,
            self.topology,
            self.policy,
            self.ledger,
            snapshot_dir=self.config.snapshot_dir,
            work_dir=self.config.work_dir,
        )
        self.members.start_job()
        self.members.form_generation()
        if self.policy.snapshots.durable_every is not None:
            self.resumed_from = self.persistence.open_durable(resume=self.config.resume)
            if self.resumed_from is not None:
                self.step = self.resumed_from
        self.layout.seed_mirrors(
            self.group, None, {}, self.ledger.ring, self.policy.timeouts.transfer
        )
        self.verified = self.step
        if self.policy.fingerprint_every:
            self.persistence.initial_snapshot(self.step)
        self.started_at = time.perf_counter()
        self.started_wall = time.time()
        self.phase = Phase.RUNNING

    # -- the phase machine ---------------------------------------------------------------

    def run(self, steps: int) -> None:
        """Advance until ``steps`` steps are committed (or the job fails).

        Raises:
            RecoveryError: when the job could not recover (the same error as ``error``).
        """
        self.target_steps = steps
        if self.phase is Phase.STARTING:
            self.start()
        while self.phase not in (Phase.FINISHED, Phase.FAILED):
            self.advance()
        if self.phase is Phase.FINISHED:
            self.persistence.flush()
        if self.phase is Phase.FAILED:
            assert self.error is not None
            raise self.error

    def advance(self) -> Phase:
        """Perform one transition of the phase machine and return the new phase."""
        try:
            if self.phase is Phase.RUNNING:
                if self.step >= self.target_steps:
                    if self._settle_commit():
                        self._finish_event(resumed=False)  # a recovery after the last commit
                        self.phase = Phase.FINISHED
                elif self.members.missing and self.members.warm_placement(self.members.missing):
                    if self._settle_commit():
                        self._grow()
                else:
                    self._train_step()
            elif self.phase is Phase.RECOVERING:
                self._plan_recovery()
            elif self.phase is Phase.REPLACING:
                self._replace()
            elif self.phase is Phase.REFORMING:
                self._reform()
            elif self.phase is Phase.RESTORING:
                self._restore()
        except RecoveryInterrupted as exc:
            if self.phase in _IN_RECOVERY and self._failure is not None:
                self._reenter(exc)
            else:
                self._give_up(exc)
        except RecoveryError as exc:
            self._give_up(exc)
        return self.phase

    def _give_up(self, exc: RecoveryError) -> None:
        log.error("%s", exc)
        self.error = exc
        self.phase = Phase.FAILED

    def _reenter(self, exc: RecoveryInterrupted) -> None:
        """A failure during the recovery: plan again with it (see [Note: re-entrant recovery])."""
        failure, rec = self._failure, self._recovery
        assert failure is not None
        restored = rec is not None and self.phase is Phase.RESTORING and rec.restores_survivors()
        rebuilding = rec.lost if rec is not None else set()
        failure.interrupt(self.phase.value, exc, rebuilding=rebuilding, survivors_restored=restored)
        hopeless = failure.hopeless(MAX_INTERRUPTIONS, self.topology)
        if hopeless is not None:
            last = f"{self.phase.value}: {exc}"
            why = f"{len(failure.interruptions)} failures during the recovery ({hopeless}), the last: {last}"
            self._give_up(RecoveryError(f"{failure.describe(self.topology)}\n{why}"))
            return
        log.warning("recovery interrupted (%s: %s); planning again", self.phase.value, exc)
        self._carried = rec.breakdown if rec is not None else {}
        self._recovery = None
        self.phase = Phase.RECOVERING

    # -- one step ------------------------------------------------------------------------

    def _train_step(self) -> None:
        assert self.group is not None
        step = self.step
        start = time.perf_counter()
        struck_at = time.time()
        check = self._check_due(step)
        decide = self._decides(step, check)
        ahead, faults = self._take_ahead(step), {}
        if ahead is not None:
            calls, count = ahead
        else:
            faults = self.faults.arm(step, self.members)
            count = self._batch(step) if decide else 1
            calls = self._submit(step, count, faults, check, decide)
        broke = self._wait_commit()  # the last step's, if it was pipelined
        nxt = step + count
        if broke:  # died applying it: this step cannot complete, and is run again
            abort_pending(self.group, self.generation)(list(calls.values()))
        elif decide and self._may_send_ahead(nxt):
            # the next steps wait in the workers' queues behind these
            # (see [Note: workers decide the commit] in recovery/worker/stage.py)
            n = self._batch(nxt)
            self._ahead = (nxt, n, self._submit(nxt, n, {}, False, True))
        outcome = await_step(self.group, calls, self.policy.timeouts.hang, self.generation)
        outcome.lost.update(broke)
        if decide:
            # Steps sent ahead began when the last one ended, not when this call began.
            began = start - self.started_at
            if ahead is not None and self.records:
                began = min(began, self.records[-1].time)
            left = self._decided(step, outcome, began, struck_at, faults)
            if left is None:  # all committed, or a failure booked
                return
            if self.step > step:  # some committed (their faults spent); the rest is left
                step, faults = self.step, {}
            outcome = left
        self._drop_ahead(outcome)
        if not outcome.ok:
            self._fail(step, outcome, struck_at, faults)
            return
        self.persistence.note(outcome.reports)
        bad = non_finite(outcome.reports)
        if bad:  # silent corruption shows up as NaN/inf: never commit it
            self.faults.spend(faults)
            numerical = StepOutcome(reports={r: outcome.reports[r] for r in bad})
            self._fail(step, numerical, struck_at, faults, numerical=bad)
            return
        if check:
            fingerprints = {r: rep.fingerprint for r, rep in outcome.reports.items()}
            verdict = vote(self.topology, {r: f for r, f in fingerprints.items() if f})
            if not verdict.agree:  # never commit it
                self.faults.spend(faults)
                self._corrupted(step, verdict, struck_at)
                return
            self.verified = step
        commits = {r: self.group.submit(r, "commit", step) for r in self.group.ranks()}
        record = self._record(step, outcome.reports, start)
        self.step = step + 1
        self._pending_commit = _PendingCommit(commits, struck_at, faults)
        if self._may_pipeline(self.step):  # the next step's calls go out before this one's are back
            self._book(record)
            return
        if not self._settle_commit():  # died while applying: committed for everyone else
            self._book(record)
            return
        self._after_commit(record, struck_at)

    def _decided(
        self, step: int, outcome: StepOutcome, began: float, struck_at: float, faults: Armed
    ) -> StepOutcome | None:
        """Book the steps from ``step`` on that the workers committed themselves (any one
        worker's commit of a step means all were ready), rolling forward the survivors
        whose vote on the last failed; recover if anyone was lost or broke meanwhile. See
        [Note: workers decide the commit] in recovery/worker/stage.py.

        Returns what is left to settle the two-phase way -- the step after the committed
        ones, that every worker ran and found not ready (a non-finite loss) -- or None.
        """
        assert self.group is not None
        chains = {r: [*rep.batch, rep] for r, rep in outcome.reports.items()}
        done = [rep for chain in chains.values() for rep in chain if rep.committed]
        if not done:
            return outcome
        self.faults.spend(faults)
        self._comm_errors = 0
        last = max(rep.step for rep in done)
        lost = dict(outcome.lost)
        held = sorted(r for r, rep in outcome.reports.items() if rep.held and rep.step == last)
        if held:
            rolled = self.group.gather(
                {r: self.group.submit(r, "commit", last) for r in held}, self.policy.timeouts.hang
            )
            lost.update(rolled.as_lost())
        records = []
        since = began  # each step is timed from the one before, by when the workers applied it
        for s in range(step, last + 1):
            reports = {
                r: rep
                for r, chain in chains.items()
                for rep in chain
                if rep.step == s and (rep.committed or rep.held)
            }
            self.persistence.note(reports)
            finished = max((rep.finished_at for rep in reports.values()), default=0.0)
            at = max(finished - self.started_wall, since)
            records.append(self._record(s, reports, elapsed=at - since, since_start=at))
            since = at
        self.step = last + 1
        failed = {r: rep for r, rep in outcome.reports.items() if not rep.ok}  # held ones too
        if lost or failed or outcome.hung:
            after = self._drop_ahead(StepOutcome(reports=failed, lost=lost))
            for record in records:
                self._book(record)
            lost.update(after.lost)
            failed.update({r: rep for r, rep in after.reports.items() if not rep.ok})
            broken = StepOutcome(reports=failed, lost=lost, hung=outcome.hung | after.hung)
            if not broken.ok:
                self._fail(self.step, broken, struck_at, {})
                return None
        for record in records[:-1]:
            self._book(record)
        if any(not rep.committed for rep in outcome.reports.values()):
            self._book(records[-1])
            return outcome  # ran and found not ready everywhere: the numerical path
        if self._ahead is not None:
            self._book(records[-1])
            return None
        self._after_commit(records[-1], struck_at)
        return None

    def _after_commit(self, record: StepRecord, struck_at: float) -> None:
        """What follows a commit that nothing was sent after: snapshots, evaluation, the
        recovery event's close, new spares."""
        try:
            if not self.members.missing:  # a shrunk job takes no snapshots (elastic.py)
                self.persistence.after_commit(self.step)
        except RecoveryInterrupted as exc:  # lost while snapshotting: the step is committed
            self._book(record)
            lost = {rank: WorkerLost(rank, str(exc)) for rank in exc.lost}
            broken = {  # alive, their call failed on a peer: not lost (a retry, if alone)
                rank: StepReport(rank=rank, step=self.step, ok=False, error=str(exc))
                for rank in exc.broken - exc.lost
            }
            self._fail(self.step, StepOutcome(reports=broken, lost=lost), struck_at, {})
            return
        if self.config.eval_every and (
            self.step % self.config.eval_every == 0 or self.step == self.target_steps
        ):
            record.val_loss = self.evaluate()
        self._book(record)
        self._finish_event()
        self._restock_spares()

    def _record(
        self,
        step: int,
        reports: dict[int, StepReport],
        start: float | None = None,
        *,
        elapsed: float | None = None,
        since_start: float | None = None,
    ) -> StepRecord:
        """The record of ``step``, timed from ``start`` (``perf_counter``) to now, or as
        given (the steps of a batch, timed by when the workers applied them)."""
        now = time.perf_counter()
        return step_record(
            self.topology,
            step,
            reports,
            elapsed=elapsed if elapsed is not None else now - (start or now),
            since_start=since_start if since_start is not None else now - self.started_at,
            tokens_per_step=self.tokens_per_step,
            generation=self.generation,
        )

    def _book(self, record: StepRecord) -> None:
        self.ledger.note_norms(record.grad_norms)
        self.records.append(record)
        self.on_step(record)

    def _decides(self, step: int, check: bool) -> bool:
        """Whether the workers decide ``step``'s commit themselves (see [Note: workers
        decide the commit] in recovery/worker/stage.py): not when the controller must
        look first (a fingerprint vote), nor in a shrunk job."""
        return not check and not self.members.missing

    def _submit(
        self, step: int, count: int, faults: Armed, check: bool, decide: bool
    ) -> dict[int, Call]:
        """Send ``step`` to every worker -- with ``decide``, it and the ``count - 1`` after
        it, in one call (`StageWorker.run_steps`)."""
        assert self.group is not None
        if decide:
            return {
                r: self.group.submit(r, "run_steps", step, count, faults.get(r, ()))
                for r in self.members.present()
            }
        return {
            r: self.group.submit(r, "run_step", step, faults.get(r, ()), check, False)
            for r in self.members.present()
        }

    def _batch(self, step: int) -> int:
        """How many steps from ``step`` the workers run in one call: while nothing needs
        the controller between two of them, up to `BATCH_STEPS` and about `BATCH_S` of
        training (by the last step's time; one until a step was timed).

        [Note: batched steps]
        Even with the workers deciding the commit, one call per step costs the controller
        a Ray call and a result per worker and a step's bookkeeping -- ~3 ms of CPU per
        step on the 2-core machine, where it competes with the workers for the cores --
        and each worker ~1 ms between two calls. So steps that need nothing from the
        controller go out several to a call; the workers run them back to back, deciding
        each commit among themselves, and report them together. The controller books
        them when the call returns, each timed by when the workers applied it, so the
        progress shown lags by at most one batch (`BATCH_S`). A failure inside a batch is
        what it would be in a step of its own: the steps before it are committed and
        booked, the rest are not run.
        """
        last = self.records[-1].step_s if self.records else 0.0
        if last <= 0:
            return 1
        most = max(1, min(BATCH_STEPS, int(BATCH_S / last)))
        n = 1
        while n < most and self._may_send_ahead(step + n):
            n += 1
        return n

    def _may_send_ahead(self, step: int) -> bool:
        """Whether ``step`` may go out before the one before it is back: the workers decide
        it and nothing needs the controller between the two."""
        return self._may_pipeline(step) and self._decides(step, self._check_due(step))

    def _take_ahead(self, step: int) -> tuple[dict[int, Call], int] | None:
        """The calls of the steps from ``step`` if they were sent ahead, and how many."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        first, count, calls = ahead
        assert first == step, (first, step)
        return calls, count

    def _drop_ahead(self, outcome: StepOutcome) -> StepOutcome:
        """The steps sent ahead are void (the one before failed or is not committed
        everywhere): abort them and wait for their calls (a worker that did not commit the
        steps before skips them). Returns their outcome."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return StepOutcome()
        assert self.group is not None
        calls = ahead[2]
        if not outcome.ok:
            abort_pending(self.group, self.generation)(list(calls.values()))
        return await_step(self.group, calls, self.policy.timeouts.hang, self.generation)

    def _may_pipeline(self, nxt: int) -> bool:
        """Whether step ``nxt``'s calls may go out before the step before it is settled:
        after its commit call (the commit is then waited for with ``nxt``'s reports), or,
        when the workers decide, behind its run.

        [Note: pipelined commit]
        A worker runs its calls in the order the controller sent them (one Ray actor
        thread; one executor per thread worker), so ``commit(k)`` is applied before
        ``run_step(k + 1)`` starts wherever both were sent. The controller therefore sends
        the next step's calls right after the commits and waits for both together: one
        round trip to every worker per step instead of two (on the 2-core machine, 10 MB
        job, the gap between a commit's end and the next step's start on a worker fell
        from ~2.2 ms to ~1 ms, Ray's own cost of a call). The step is committed when every
        report said ready, as before; a worker that dies or breaks while applying it is
        found when the commits are waited for and fails the next step, which is abandoned
        everywhere and run again after the recovery -- what a death in the commit did
        before, one step later. When the workers decide the commit, ``run_step(k + 1)``
        goes out with ``run_step(k)``: a worker that did not commit ``k`` skips it.
        Only when nothing else needs the update applied first: no snapshot or checkpoint
        or evaluation due, not the last step, no recovery event waiting for its first
        commit (its time runs to the commit applied), not a shrunk job (it may grow at
        the boundary), and no injected fault due at ``nxt`` (it is armed when sent).
        """
        return (
            nxt < self.target_steps
            and self._pending_event is None
            and not self._restock
            and not self.members.missing
            and not self.persistence.due(nxt)
            and not (self.config.eval_every and nxt % self.config.eval_every == 0)
            and not self.faults.due(nxt)
        )

    def _wait_commit(self) -> dict[int, WorkerLost]:
        """Wait for the commits in flight: the workers that died or broke applying them
        (their step stays committed for everyone else)."""
        pending, self._pending_commit = self._pending_commit, None
        if pending is None:
            return {}
        assert self.group is not None
        commits = self.group.gather(pending.calls, self.policy.timeouts.hang)
        lost = commits.as_lost()  # a worker that broke mid-update is rebuilt, too
        self.faults.spend(pending.faults, lost or None)
        if not lost:
            self._comm_errors = 0
        return lost

    def _settle_commit(self) -> bool:
        """Wait for the commits in flight; False if a worker died or broke applying them
        (the failure is then booked: the job recovers before the next step)."""
        pending = self._pending_commit
        lost = self._wait_commit()
        if lost and pending is not None:
            self._fail(self.step, StepOutcome(lost=lost), pending.struck_at, pending.faults)
        return not lost

    def _restock_spares(self) -> None:
        """Start the spares a recovery took, now that training is back.

        [Note: restocking spares after the first step]
        A spare starting is a Ray worker process importing torch, then building a stage and
        running a step to warm it: seconds of CPU. Started during the recovery, it competed
        with the recovery's transfer and first step wherever it shares cores with the
        workers (measured on the 2-core machine, 100 MB 1x2 job: the first step after a
        warm-spare recovery took 0.45 s instead of 0.25-0.30, and kill -> training again
        0.72 s instead of 0.52). So a recovery only takes spares, and the job asks for new
        ones after its first commit. A failure before that commit finds one spare fewer,
        as it would while a spare warms up anyway. (The steps right after still share the
        cores with the new spare while it starts, on a machine this small.)
        """
        if not self._restock or self.group is None:
            return
        self._restock = False
        self.members.add_spares(self.policy.hot_spares - self.group.spare_count())

    def evaluate(self) -> float | None:
        """Mean held-out loss over ``eval_batches`` batches (forward only, every pipeline).

        A failure during evaluation is handled like one during a step (the phase becomes
        RECOVERING) and the evaluation is skipped: returns None.
        """
        assert self.group is not None
        if self.spec.val_batches is None:
            return math.nan
        total, count = 0.0, 0
        for index in range(self.config.eval_batches):
            struck_at = time.time()
            outcome = self._everyone("evaluate", lambda r: (index,))  # noqa: B023 (called at once)
            if not outcome.ok:
                self._fail(self.step, outcome, struck_at, {})
                return None
            total += sum(r.stats.loss_sum for r in outcome.reports.values())
            count += sum(r.stats.losses for r in outcome.reports.values())
        return total / count if count else math.nan

    def _everyone(self, method: str, args: Callable[[int], tuple[Any, ...]]) -> StepOutcome:
        """Run a step-like ``method`` on every rank (a rank without a worker is lost)."""
        assert self.group is not None
        ranks = self.members.present()
        calls = {r: self.group.submit(r, method, *args(r)) for r in ranks}
        return await_step(self.group, calls, self.policy.timeouts.hang, self.generation)

    def _fail(
        self,
        step: int,
        outcome: StepOutcome,
        struck_at: float,
        faults: Armed,
        *,
        numerical: dict[int, str] | None = None,
    ) -> None:
        lost = set(outcome.lost)
        injected = fault_time(
            self.members.store, self.generation, lost | set(numerical or outcome.failed)
        )
        self.faults.spend(faults, lost | outcome.hung)
        self._failure = failure_of(
            step,
            outcome,
            numerical=numerical,
            node_lost=self.members.on_lost_node(lost),
            struck_at=injected if injected is not None else struck_at,
            generation=self.generation,
        )
        log.warning(
            "step %d failed (%s): lost %s",
            step,
            self._failure.cause,
            ", ".join(str(self.topology.worker(r)) for r in sorted(lost)) or "nobody",
        )
        self.phase = Phase.RECOVERING

    def _check_due(self, step: int) -> bool:
        """Whether the workers fingerprint their state at ``step``: every
        ``fingerprint_every`` steps, and at every snapshot step, so that the newest snapshot
        known clean is always one the workers still keep (see [Note: fingerprint vote])."""
        every = self.policy.fingerprint_every or 0
        if every <= 0:
            return False
        snapshots = self.policy.snapshots
        return any(
            n and step % n == 0 for n in (every, snapshots.peer_every, snapshots.durable_every)
        )

    def _corrupted(self, step: int, verdict: Verdict, struck_at: float) -> None:
        """A fingerprint mismatch at ``step``: take the odd workers out if the majority can
        rebuild them, else (nobody lost) everyone rolls back; see [Note: fingerprint vote]."""
        voted = can_vote(verdict, step, self.verified, self.policy)
        injected = fault_time(self.members.store, self.generation, verdict.suspects)
        self._failure = Failure(
            step=step,
            lost=set(verdict.suspects) if voted else set(),
            cause="corrupted",
            detected_at=time.time(),
            struck_at=injected if injected is not None else struck_at,
            errors=verdict.describe(self.topology),
            generation=self.generation,
            corruption=verdict,
        )
        log.warning(
            "step %d: fingerprints disagree in stage(s) %s (last agreed at step %d): %s",
            step,
            list(verdict.mismatched),
            self.verified,
            "; ".join(
                f"{self.topology.worker(r)}: {e}" for r, e in sorted(self._failure.errors.items())
            ),
        )
        self.phase = Phase.RECOVERING

    # -- recovery, one phase per transition ----------------------------------------------

    def _plan_recovery(self) -> None:
        """RECOVERING: survivors abandon the step and leave; the planner decides."""
        assert self.group is not None and self._failure is not None
        failure, most = self._failure, self.policy.max_recoveries
        if most is not None and len(self.events) >= most:
            raise RecoveryError(f"{failure.describe(self.topology)}\nmax_recoveries={most} reached")
        failure.lost |= self.members.missing  # a shrink's missing are rebuilt with the rest
        lost, blanks, reports = self.members.leave_generation(set(failure.lost), failure.blanks)
        if failure.cause == "communication error" and not lost:
            self._back_off(failure)
        self.persistence.note(reports)
        self.persistence.commit_landed()
        alive = {rank: report.step for rank, report in reports.items()}
        assessed = (
            {}
            if failure.numerical
            else self.layout.assess(
                self.group, lost, alive, self.ledger.ring, self.policy.timeouts.control
            )
        )
        self.ledger.forget(lost)
        self._recovery = rec = _Recovery(failure, lost, alive, assessed, dict(self._carried))
        rec.blanks = blanks
        self._carried = {}
        rec.plan = self._plan(rec)
        log.info("%s", rec.plan.describe(self.topology))
        self.phase = Phase.REPLACING

    def _back_off(self, failure: Failure) -> None:
        """A communication error and every worker alive: wait, then retry -- or give up after
        ``comm_retries`` in a row (see [Note: communication errors with nobody lost])."""
        self._comm_errors += 1
        most = self.policy.comm_retries
        if self._comm_errors > most:
            raise RecoveryError(
                f"{failure.describe(self.topology)}\n{self._comm_errors} communication errors "
                f"in a row with every worker alive (comm_retries={most}): giving up"
            )
        delay = min(COMM_BACKOFF_S * 2 ** (self._comm_errors - 1), MAX_COMM_BACKOFF_S)
        log.warning(
            "communication error with every worker alive (%d of %d retries): retrying in %.2f s",
            self._comm_errors,
            most,
            delay,
        )
        time.sleep(delay)

    def _plan(self, rec: _Recovery) -> RecoveryPlan:
        redundancy = self.layout.redundancy(self.ledger, rec.alive, rec.assessed)
        numerical = rec.failure.numerical
        try:
            if rec.failure.corruption is not None:
                return corruption_plan(
                    self.topology,
                    rec.failure.corruption,
                    step=rec.failure.step,
                    verified=self.verified,
                    lost=rec.lost,
                    redundancy=redundancy,
                    policy=self.policy,
                )
            planned = plan(
                self.topology,
                rec.lost,
                redundancy,
                self.policy,
                rollback_all=numerical or rec.failure.suspect,
            )
            return grow_plan(planned) if rec.failure.cause == _GROW else planned
        except RedundancyExhausted as exc:
            raise RedundancyExhausted(f"{rec.failure.describe(self.topology)}\n{exc}") from None

    def _replace(self) -> None:
        """REPLACING: workers for the lost ranks -- the blanks of an interrupted recovery set
        up afresh where they live, new processes for the others; survivors restore in
        place -- except in the restart baseline, where everyone goes and comes back cold."""
        assert self.group is not None and self._recovery is not None
        rec = self._recovery
        t0 = time.perf_counter()
        cold = rec.plan.strategy == Strategy.RESTART
        renewed: set[int] = set()
        if cold:
            rebuild = list(range(self.topology.world_size))
            self.group.kill(set(rec.alive) | rec.blanks)
        else:
            renewed = self.members.renew(rec.blanks)
            rebuild = sorted(rec.lost - renewed)
            if rebuild and self._can_shrink(rec):  # a cold start would stall everyone
                warm = self.members.warm_placement(rebuild)
                self._shrink(rec, warm, "no warm spare is ready", t0, renewed)
                return
        placement = self.members.replacements(rebuild)
        try:
            started = (
                self.members.start(placement, spares=not cold, what="start replacement workers")
                if placement
                else set()
            )
        except PlacementFailed as exc:  # no room
            if not cold and self._can_shrink(rec):
                self._shrink(rec, {}, str(exc), t0, renewed)
                return
            why = f"{rec.failure.describe(self.topology)}\n{exc}"
            raise PlacementFailed(why, unplaced=exc.unplaced) from None
        rec.warm = started | renewed
        self.members.missing = set()
        self._restock = not cold
        rec.add_time("replace", t0)
        self.phase = Phase.REFORMING

    def _can_shrink(self, rec: _Recovery) -> bool:
        """Whether this recovery may leave its lost workers out (see [Note: elastic shrink])."""
        return self.policy.elastic and shrinkable(self.topology, rec.plan, rec.lost)

    def _shrink(
        self,
        rec: _Recovery,
        warm: dict[int, str],
        why: str,
        since: float,
        renewed: Collection[int] = (),
    ) -> None:
        """Bring back the lost workers that have a ready spare (``warm``: rank -> the node of
        its spare) or a live worker set up afresh (``renewed``), train on without the
        others, and ask for their replacements as spares, placed wherever there is room,
        to grow back with (see [Note: elastic shrink])."""
        assert self.group is not None
        left_out = rec.lost - set(warm) - set(renewed)
        rec.warm = set(renewed)
        self.group.kill(left_out)
        back = sorted(warm)
        if back:
            placement = {rank: warm[rank] for rank in back}
            try:
                rec.warm |= self.members.start(
                    placement, spares=True, what="start replacement workers"
                )
            except PlacementFailed:  # the spares went meanwhile: leave those out too
                self.group.kill(back)
                left_out |= set(back)
        rec.plan = shrink_plan(rec.plan, left_out)
        self.members.missing = set(left_out)
        wanted = self.policy.hot_spares + len(left_out)
        self.members.add_spares(wanted - self.group.spare_count(), anywhere=True)
        if left_out:
            log.warning(
                "shrinking: training on without %s until their replacements are ready (%s)",
                ", ".join(str(self.topology.worker(r)) for r in sorted(left_out)),
                why.splitlines()[0][:300],
            )
        rec.add_time("replace", since)
        self.phase = Phase.REFORMING

    def _grow(self) -> None:
        """Some missing workers have a ready spare: bring them back at this step boundary (a
        recovery whose plan copies each from a live replica of its stage; the ones still
        without a spare stay out)."""
        now = time.time()
        self._failure = Failure(
            step=self.step,
            lost=set(self.members.missing),
            cause=_GROW,
            detected_at=now,
            struck_at=now,
            errors={},
            generation=self.generation,
        )
        log.info("growing back: replacements are ready")  # (some of them, maybe)
        self.phase = Phase.RECOVERING

    def _reform(self) -> None:
        """REFORMING: the next generation's process groups, on a fresh store prefix."""
        assert self._recovery is not None
        self._recovery.ring_before = dict(self.ledger.ring)
        t0 = time.perf_counter()
        self.members.form_generation()
        self._recovery.add_time("reform", t0)
        self.phase = Phase.RESTORING

    def _restore(self) -> None:
        """RESTORING: the plan's transfers, then the shard mirrors; resume training."""
        assert self.group is not None and self._recovery is not None
        rec = self._recovery
        t0 = time.perf_counter()
        ctx = self.persistence.restore_context(self.generation)
        rec.plan, moved = execute_or_fall_back(ctx, rec.plan, lambda: self._plan(rec))
        try:
            moved += self.layout.seed_mirrors(
                self.group, rec.plan, rec.ring_before, self.ledger.ring, ctx.timeout
            )
        except RecoveryInterrupted as exc:  # half-seeded mirrors: no plan may trust them
            raise RecoveryError(f"could not re-seed the shard mirrors: {exc}") from None
        embedding = self.layout.account(rec.plan, rec.alive, rec.assessed)
        rec.add_time("transfer", t0)
        corrupted = self.ledger.recovered()  # every live worker is a trusted source again
        event = recovery_event(
            self.topology,
            rec.failure,
            rec.plan,
            lost=rec.lost,
            warm=rec.warm,
            moved=moved,
            generation=self.generation,
            started_wall=self.started_wall,
            breakdown=rec.breakdown,
            embedding=embedding,
            transfers_corrupted=corrupted,
        )
        self._finish_event(resumed=False)  # the last recovery's next step failed, too
        if not (rec.failure.cause == _GROW and rec.plan.strategy == Strategy.SHRINK):
            self._pending_event = PendingEvent(event)  # (a grow that found no spare: no event)
        self._failure = self._recovery = None
        self.step = rec.plan.resume_step
        if rec.plan.strategy == Strategy.REPLICA_VOTE:  # everyone holds the majority's state
            self.verified = self.step
        elif rec.plan.tier is not None or rec.plan.strategy == Strategy.RESTART:
            self.verified = min(self.verified, self.step)  # rolled back: older is all we know
        self.phase = Phase.RUNNING

    def _finish_event(self, *, resumed: bool = True) -> None:
        """After the first commit following a recovery, close and publish its event.

        ``resumed=False``: the job ended with the recovery (no step left to resume).
        """
        if self._pending_event is not None:
            event, self._pending_event = self._pending_event.close(resumed=resumed), None
            self.events.append(event)
            self.on_event(event)

    # -- results and shutdown ------------------------------------------------------------

    def states(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Every worker's final state, keyed by (stage, replica).

        Raises:
            RecoveryError: if a worker is lost while its state is read.
        """
        assert self.group is not None
        return self.layout.states(self.group, self.policy.timeouts.transfer)

    def mirror_costs(self) -> dict[str, float]:
        """What the layout's redundancy costs per worker (embedding mirrors); empty: nothing."""
        if self.group is None or not self.group.ranks():
            return {}
        return self.layout.costs(self.group, self.policy.timeouts.control)

    def shutdown(self) -> None:
        """Release every worker (parked for reuse after a clean finish); drop the store."""
        if self.group is not None:
            self.group.shutdown(clean=self.phase is Phase.FINISHED)
        if hasattr(self, "members"):
            self.members.close()
