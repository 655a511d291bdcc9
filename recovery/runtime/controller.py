"""The controller: a small phase machine that drives one job over a `WorkerGroup`.

It runs in the driver process (the one that calls `Trainer.fit`), never on a worker, so
losing any worker never loses the store or the job's bookkeeping. Its state is one object
per phase, carrying what that phase works on (recovery/runtime/states.py); `advance`
performs exactly one transition -- the state in, the next state out -- which is what tests
drive (over a `ThreadWorkerGroup`, no Ray). In RUNNING the step runner
(recovery/runtime/steps.py) runs the next steps -- one call, or a batch of up to 16 --
and answers `Committed` or `Failed`:

    STARTING --start()--> RUNNING --committed--> RUNNING --all steps--> FINISHED
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

What each part does lives elsewhere: the failure-free steps (steps.py), detection
(detection.py), injected faults (injection.py), placement, spares and generations
(membership.py), the redundancy that exists (ledger.py), snapshots and checkpoints
(persistence.py), the plan's transfers (executor.py), what differs per kind of state
(layouts.py). The controller decides nothing itself: what to rebuild is the planner's
(recovery/planner.py), when to retry, shrink, grow or give up is a pure function's
(decisions.py); the controller carries it out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from parallelism.devices import Backend, Device
from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.errors import (
    RecoveryError,
    RecoveryInterrupted,
    RedundancyExhausted,
)
from recovery.events import RecoveryEvent
from recovery.faults import FailureSchedule
from recovery.faults.injection import InjectedFaults
from recovery.groups.group import WorkerGroup
from recovery.names import FailureCause, Strategy
from recovery.planner import RecoveryPlan, Redundancy, corruption_plan, plan
from recovery.policy import RecoveryPolicy
from recovery.rundir import FolderLock
from recovery.runtime.decisions import (
    MAX_INTERRUPTIONS,
    AtBoundary,
    OnFailure,
    Replace,
    Retry,
    at_boundary,
    on_comm_error,
    on_failure,
    on_interruption,
)
from recovery.runtime.elastic import grow_plan
from recovery.runtime.executor import execute_or_fall_back
from recovery.runtime.layouts import StateLayout, layout_for
from recovery.runtime.ledger import RedundancyLedger
from recovery.runtime.membership import Membership
from recovery.runtime.persistence import Persistence, claim_snapshot_folder
from recovery.runtime.records import Failure, PendingEvent, StepRecord, recovery_event
from recovery.runtime.replacing import replace_lost
from recovery.runtime.states import (
    IN_RECOVERY,
    Errored,
    Finished,
    Phase,
    Recovering,
    Recovery,
    Reforming,
    Replacing,
    Restoring,
    Running,
    Starting,
    State,
    failure_in,
    rebuilding_in,
)
from recovery.runtime.steps import Failed, StepRunner
from recovery.runtime.stragglers import straggler_failure
from recovery.worker import WorkerInfo

__all__ = ["MAX_INTERRUPTIONS", "Controller", "ControllerConfig", "Phase"]

log = logging.getLogger("checkfree")


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
    """Resume from the newest intact durable snapshot in ``snapshot_dir``, if one exists.
    False: start afresh; a ``snapshot_dir`` holding complete snapshots is then refused at
    the start (`claim_snapshot_folder`)."""
    reshard: bool = False
    """With ``resume``, also resume from a snapshot another topology wrote, by parameter
    name (``Trainer(resume="reshard")``; see [Note: resharding a snapshot])."""
    worker_options: dict[str, Any] = field(default_factory=dict)
    """Extra Ray actor options for every worker (`RayWorkerGroup` only)."""
    worker_resources: dict[str, float] | None = None
    """What each worker and hot spare asks Ray for (`Trainer(worker_resources=...)`; see
    recovery/groups/resources.py); None: the default. `RayWorkerGroup` only."""


def _ray_group(layout: StateLayout, config: ControllerConfig) -> WorkerGroup:
    """The default group: Ray actors (Ray is imported only when it is used)."""
    from recovery.groups.ray_group import RayWorkerGroup

    return RayWorkerGroup.connect(
        layout.worker_cls,
        threads=config.threads_per_worker,
        backend=config.backend,
        device=config.device,
        resources=config.worker_resources,
        options=config.worker_options,
    )


def plan_recovery(
    topology: Topology,
    policy: RecoveryPolicy,
    failure: Failure,
    lost: set[int],
    redundancy: Redundancy,
    verified: int,
) -> RecoveryPlan:
    """The plan for ``failure``: the fingerprint vote's for a corruption, the planner's
    otherwise (everyone rolls back after a non-finite value or an interrupted rollback;
    a grow copies its workers from live replicas)."""
    try:
        if failure.corruption is not None:
            return corruption_plan(
                topology,
                failure.corruption,
                step=failure.step,
                verified=verified,
                lost=lost,
                redundancy=redundancy,
                policy=policy,
            )
        planned = plan(
            topology, lost, redundancy, policy, rollback_all=failure.numerical or failure.suspect
        )
        return grow_plan(planned) if failure.cause == FailureCause.GROW else planned
    except RedundancyExhausted as exc:
        raise RedundancyExhausted(f"{failure.describe(topology)}\n{exc}") from None


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
        self.state: State = Starting()
        self.target_steps = 0
        self.records: list[StepRecord] = []
        self.events: list[RecoveryEvent] = []
        self.error: BaseException | None = None
        self.started_at = time.perf_counter()
        self.started_wall = time.time()
        self.resumed_from: int | None = None
        self.ledger = RedundancyLedger(topology)
        self.tokens_per_step = 0
        self._restock = False
        """A recovery took spares: the runner starts new ones after its first commit."""
        self.layout: StateLayout
        self.members: Membership | None = None
        self.persistence: Persistence
        self.runner: StepRunner | None = None
        self._folder_lock: FolderLock | None = None
        """The durable snapshot folder's, held from `start` to `shutdown`."""

    # -- views ---------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def step(self) -> int:
        """The next step to run: every step before it is committed."""
        return self.runner.step if self.runner is not None else 0

    @property
    def verified(self) -> int:
        """The newest step whose fingerprints agreed in every stage group (see [Note:
        fingerprint vote] in recovery/integrity/fingerprint_vote.py)."""
        return self.runner.verified if self.runner is not None else 0

    @property
    def failure(self) -> Failure | None:
        """The failure a recovery under way recovers from."""
        return failure_in(self.state)

    @property
    def generation(self) -> int:
        """The process groups' generation (0 from `start`; one more per re-formation)."""
        return self.members.generation if self.members is not None else -1

    def infos(self) -> dict[int, WorkerInfo]:
        """Where each live worker runs."""
        assert self.group is not None
        return {rank: self.group.info(rank) for rank in self.group.ranks()}

    def rebuilding(self) -> set[int]:
        """The ranks whose worker holds no trustworthy state now: those a failure found
        lost and a recovery under way is rebuilding, and those a shrink left out. (Read
        from another thread: a snapshot, not a promise.)"""
        members = self.members
        return rebuilding_in(self.state) | (members.missing if members is not None else set())

    # -- startup -------------------------------------------------------------------------

    def start(self) -> None:
        """Validate, host the store, start and set up every worker, form generation 0.

        Raises:
            ValueError: for a spec, policy and backend that do not combine (before any
                worker starts).
            RecoveryError: if workers cannot be started or set up.
        """
        assert isinstance(self.state, Starting)
        self.tokens_per_step = self.spec.check(self.topology)
        self.layout = layout_for(self.spec, self.topology, self.policy, self.tokens_per_step)
        self.layout.validate(self.config.backend, self.config.device)
        self._folder_lock = claim_snapshot_folder(
            self.policy, self.config.snapshot_dir, resume=self.config.resume
        )
        self.group = group = self.group or _ray_group(self.layout, self.config)
        group.check_capacity(self.topology.world_size + self.policy.hot_spares)
        self.members = members = Membership(
            group,
            self.spec,
            self.topology,
            self.policy,
            self.layout,
            self.ledger,
            host=group.store_host(),
            backend=self.config.backend,
            device=self.config.device,
        )
        self.faults.check_nodes(len(members.job_nodes))
        self.persistence = Persistence(
            group,
            self.spec,
            self.topology,
            self.policy,
            self.ledger,
            snapshot_dir=self.config.snapshot_dir,
            work_dir=self.config.work_dir,
        )
        members.start_job()
        members.form_generation()
        step = 0
        if self.policy.snapshots.durable_every is not None:
            self.resumed_from = self.persistence.open_durable(
                resume=self.config.resume, reshard=self.config.reshard
            )
            if self.resumed_from is not None:
                step = self.resumed_from
        self.layout.seed_mirrors(group, None, {}, self.ledger.ring, self.policy.timeouts.transfer)
        if self.policy.fingerprint_every:
            self.persistence.initial_snapshot(step)
        self.started_at = time.perf_counter()
        self.started_wall = time.time()
        self.runner = StepRunner(
            group=group,
            members=members,
            persistence=self.persistence,
            faults=self.faults,
            spec=self.spec,
            topology=self.topology,
            policy=self.policy,
            eval_every=self.config.eval_every,
            eval_batches=self.config.eval_batches,
            tokens_per_step=self.tokens_per_step,
            step=step,
            started_at=self.started_at,
            started_wall=self.started_wall,
        )
        self.state = Running()

    # -- the phase machine ---------------------------------------------------------------

    def run(self, steps: int) -> None:
        """Advance until ``steps`` steps are committed (or the job fails).

        Raises:
            RecoveryError: when the job could not recover (the same error as ``error``).
        """
        self.target_steps = steps
        if isinstance(self.state, Starting):
            self.start()
        while not isinstance(self.state, Finished | Errored):
            self.advance()
        if isinstance(self.state, Finished):
            self.persistence.flush()
        if isinstance(self.state, Errored):
            raise self.state.error

    def advance(self) -> Phase:
        """Perform one transition of the phase machine and return the new phase."""
        state = self.state
        try:
            self.state = self._next(state)
        except RecoveryInterrupted as exc:
            if isinstance(state, IN_RECOVERY):
                self.state = self._reenter(state, exc)
            else:
                self.state = self._give_up(exc)
        except RecoveryError as exc:
            self.state = self._give_up(exc)
        return self.state.phase

    def _next(self, state: State) -> State:
        match state:
            case Running():
                return self._running()
            case Recovering():
                return self._recovering(state)
            case Replacing():
                return self._replacing(state.recovery)
            case Reforming():
                return self._reforming(state.recovery)
            case Restoring():
                return self._restoring(state.recovery)
        raise AssertionError(f"no transition from {state.phase.value}")

    def _give_up(self, exc: RecoveryError) -> Errored:
        log.error("%s", exc)
        self.error = exc
        return Errored(exc)

    def _reenter(self, state: State, exc: RecoveryInterrupted) -> State:
        """A failure during the recovery: plan again with it (see [Note: re-entrant recovery])."""
        failure = failure_in(state)
        assert failure is not None
        rec = state.recovery if isinstance(state, Replacing | Reforming | Restoring) else None
        restored = isinstance(state, Restoring) and state.recovery.restores_survivors()
        failure.interrupt(
            state.phase.value,
            exc,
            rebuilding=rec.lost if rec is not None else set(),
            survivors_restored=restored,
        )
        hopeless = failure.hopeless(MAX_INTERRUPTIONS, self.topology)
        if on_interruption(hopeless) is Retry.GIVE_UP:
            last = f"{state.phase.value}: {exc}"
            why = f"{len(failure.interruptions)} failures during the recovery ({hopeless}), the last: {last}"
            return self._give_up(RecoveryError(f"{failure.describe(self.topology)}\n{why}"))
        log.warning("recovery interrupted (%s: %s); planning again", state.phase.value, exc)
        carried = rec.breakdown if rec is not None else {}
        return Recovering(failure, carried)

    def _book(self, records: list[StepRecord]) -> None:
        for record in records:
            self.ledger.note_norms(record.grad_norms)
            self.records.append(record)
            self.on_step(record)

    def _publish(self, event: RecoveryEvent | None) -> None:
        if event is not None:
            self.events.append(event)
            self.on_event(event)

    # -- RUNNING: the runner steps ---------------------------------------------------------

    def _running(self) -> State:
        runner, members = self.runner, self.members
        assert runner is not None and members is not None
        # Stragglers once nothing is in flight: nothing is sent ahead while some are found,
        # so the next advance settles what is (see [Note: stragglers]).
        missing, slow = members.missing, runner.stragglers.found if runner.idle else []
        ready = bool(missing) and bool(members.warm_placement(missing))
        decision = at_boundary(
            runner.step,
            self.target_steps,
            missing=bool(missing),
            spares_ready=ready,
            stragglers=bool(slow),
        )
        if decision is AtBoundary.STEP:
            result = runner.advance(self.target_steps)
            self._book(result.records)
            if isinstance(result, Failed):
                return Recovering(result.failure)
            self._publish(result.event)
            runner.restock_spares()  # (after the event: its time does not include them)
            return Running()
        failed = runner.settle()  # the commit in flight, first
        if failed is not None:
            return Recovering(failed.failure)
        if decision is AtBoundary.GROW:
            log.info("growing back: replacements are ready")  # (some of them, maybe)
            return Recovering(self._grow_failure())
        if decision is AtBoundary.STRAGGLER:  # replaced as if dead (see [Note: stragglers])
            for s in slow:
                log.warning("worker %s: %s", self.topology.worker(s.rank), s.describe())
            members.note_stragglers(s.rank for s in slow)
            failure = straggler_failure(
                self.topology, slow, step=runner.step, generation=self.generation
            )
            return Recovering(failure)
        self._publish(runner.close_event())  # a recovery after the last commit
        return Finished()

    def _grow_failure(self) -> Failure:
        """Some missing workers have a ready spare: bring them back at this step boundary (a
        recovery whose plan copies each from a live replica of its stage; the ones still
        without a spare stay out)."""
        assert self.members is not None
        now = time.time()
        return Failure(
            step=self.step,
            lost=set(self.members.missing),
            cause=FailureCause.GROW,
            detected_at=now,
            struck_at=now,
            errors={},
            generation=self.generation,
        )

    # -- recovery, one phase per transition ----------------------------------------------

    def _recovering(self, state: Recovering) -> State:
        """RECOVERING: survivors abandon the step and leave; the planner decides."""
        assert self.group is not None and self.members is not None
        failure, most = state.failure, self.policy.max_recoveries
        if on_failure(len(self.events), most) is OnFailure.GIVE_UP:
            raise RecoveryError(f"{failure.describe(self.topology)}\nmax_recoveries={most} reached")
        failure.lost |= self.members.missing  # a shrink's missing are rebuilt with the rest
        lost, blanks, reports = self.members.leave_generation(set(failure.lost), failure.blanks)
        if failure.cause == FailureCause.COMMUNICATION and not lost:
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
        planned = self._plan_for(failure, lost, alive, assessed)
        rec = Recovery(failure, lost, alive, assessed, planned, dict(state.carried), blanks=blanks)
        log.info("%s", rec.plan.describe(self.topology))
        return Replacing(rec)

    def _back_off(self, failure: Failure) -> None:
        """A communication error and every worker alive: wait, then retry -- or give up after
        ``comm_retries`` in a row (see [Note: communication errors with nobody lost])."""
        assert self.runner is not None
        self.runner.comm_errors += 1
        in_a_row, most = self.runner.comm_errors, self.policy.comm_retries
        decision = on_comm_error(in_a_row, most)
        if decision.decision is Retry.GIVE_UP:
            raise RecoveryError(
                f"{failure.describe(self.topology)}\n{in_a_row} communication errors "
                f"in a row with every worker alive (comm_retries={most}): giving up"
            )
        log.warning(
            "communication error with every worker alive (%d of %d retries): retrying in %.2f s",
            in_a_row,
            most,
            decision.delay_s,
        )
        time.sleep(decision.delay_s)

    def _plan_for(
        self,
        failure: Failure,
        lost: set[int],
        alive: dict[int, int],
        assessed: dict[int, dict[str, int]],
    ) -> RecoveryPlan:
        """The planner's decision on what survives (recovery/planner.py, recovery/integrity/fingerprint_vote.py)."""
        redundancy = self.layout.redundancy(self.ledger, alive, assessed)
        return plan_recovery(self.topology, self.policy, failure, lost, redundancy, self.verified)

    def _replacing(self, rec: Recovery) -> State:
        """REPLACING: workers for the lost ranks (recovery/runtime/replacing.py)."""
        assert self.group is not None and self.members is not None
        how = replace_lost(rec, self.group, self.members, self.topology, self.policy)
        if how is Replace.START:  # (a shrink asks for its spares itself)
            self._restock = rec.plan.strategy != Strategy.RESTART
        return Reforming(rec)

    def _reforming(self, rec: Recovery) -> State:
        """REFORMING: the next generation's process groups, on a fresh store prefix."""
        assert self.members is not None
        rec.ring_before = dict(self.ledger.ring)
        t0 = time.perf_counter()
        self.members.form_generation()
        rec.add_time("reform", t0)
        return Restoring(rec)

    def _restoring(self, rec: Recovery) -> State:
        """RESTORING: the plan's transfers, then the shard mirrors; resume training."""
        assert self.group is not None and self.runner is not None
        t0 = time.perf_counter()
        ctx = self.persistence.restore_context(self.generation)
        rec.plan, moved = execute_or_fall_back(
            ctx, rec.plan, lambda: self._plan_for(rec.failure, rec.lost, rec.alive, rec.assessed)
        )
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
        self._publish(self.runner.close_event())  # the last recovery's next step failed, too
        # (a grow that found no spare: no event)
        quiet = rec.failure.cause == FailureCause.GROW and rec.plan.strategy == Strategy.SHRINK
        step, verified = rec.plan.resume_step, self.verified
        if rec.plan.strategy == Strategy.REPLICA_VOTE:  # everyone holds the majority's state
            verified = step
        elif rec.plan.tier is not None or rec.plan.strategy == Strategy.RESTART:
            verified = min(verified, step)  # rolled back: older is all we know
        self.runner.resume(
            step,
            verified=verified,
            event=None if quiet else PendingEvent(event),
            restock=self._restock,
        )
        self._restock = False
        return Running()

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
        """Release every worker (parked for reuse after a clean finish); drop the store;
        let the snapshot folder go."""
        try:
            if self.group is not None:
                self.group.shutdown(clean=isinstance(self.state, Finished))
            if self.members is not None:
                self.members.close()
        finally:
            if self._folder_lock is not None:
                self._folder_lock.release()
