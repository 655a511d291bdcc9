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

What each part does lives elsewhere: detection (recovery/runtime/detection.py), the
redundancy that exists (ledger.py), snapshots and checkpoints (persistence.py), the plan's
transfers (executor.py), what differs per kind of state (layouts.py). The controller
decides nothing the planner did not decide.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from parallelism.comm import Rendezvous, host_store
from parallelism.topology import Topology
from recovery.errors import RecoveryError, RedundancyExhausted, SnapshotCorrupted
from recovery.events import RecoveryEvent
from recovery.faults import FailureSchedule, Fault, Kill, KillNode, WorkerFault
from recovery.names import Strategy
from recovery.placement import place, replacement_node
from recovery.planner import RecoveryPlan, plan
from recovery.policy import RecoveryPolicy
from recovery.ray_env import connect, driver_host
from recovery.runtime.detection import StepOutcome, await_step, non_finite
from recovery.runtime.executor import Restore, execute
from recovery.runtime.group import WorkerGroup, seconds
from recovery.runtime.layouts import StateLayout, layout_for
from recovery.runtime.ledger import RedundancyLedger
from recovery.runtime.persistence import Persistence
from recovery.runtime.records import Failure, StepRecord, recovery_event, step_record
from recovery.snapshots import buddies
from recovery.spec import TrainSpec
from recovery.worker import WorkerInfo

__all__ = ["Controller", "ControllerConfig", "Phase"]

log = logging.getLogger("checkfree")


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
class ControllerConfig:
    """How the controller runs the job (set by `Trainer`)."""

    backend: str
    threads_per_worker: int = 1
    eval_every: int = 0
    eval_batches: int = 1
    work_dir: str | None = None
    """Where the restart baseline writes checkpoints (default: a temp folder)."""
    snapshot_dir: str | None = None
    """Where durable snapshots go (required when the policy sets ``durable_every``)."""
    resume: bool = True
    """Resume from the newest intact durable snapshot in ``snapshot_dir``, if one exists."""
    worker_options: dict[str, Any] = field(default_factory=dict)
    """Extra Ray actor options for every worker (`RayWorkerGroup` only)."""


@dataclass
class _Recovery:
    """A recovery in progress, carried from phase to phase."""

    failure: Failure
    lost: set[int]
    alive: dict[int, int]
    assessed: dict[int, dict[str, int]]
    plan: RecoveryPlan
    breakdown: dict[str, float] = field(default_factory=dict)
    warm: set[int] = field(default_factory=set)
    ring_before: dict[int, int] = field(default_factory=dict)


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
        self.failures = failures or FailureSchedule()
        self.group = group
        self.on_step = on_step or (lambda record: None)
        self.on_event = on_event or (lambda event: None)
        self.phase = Phase.STARTING
        self.generation = -1
        self.step = 0
        self.target_steps = 0
        self.assignment: dict[int, str] = {}
        """Rank -> the node its worker runs on (as started)."""
        self._hosts: dict[int, str] = {}
        self.job_nodes: list[str] = []
        self.lost_nodes: set[str] = set()
        self.records: list[StepRecord] = []
        self.events: list[RecoveryEvent] = []
        self.error: BaseException | None = None
        self.started_at = time.perf_counter()
        self.started_wall = time.time()
        self.started_ray = False
        self.resumed_from: int | None = None
        self.ledger = RedundancyLedger(topology)
        self._store: Any = None
        self._host = "127.0.0.1"
        self._fired: set[Fault] = set()
        self._failure: Failure | None = None
        self._recovery: _Recovery | None = None
        self._pending_event: tuple[RecoveryEvent, float] | None = None
        self.tokens_per_step = 0
        self.layout: StateLayout
        self.persistence: Persistence

    # -- views ---------------------------------------------------------------------------

    @property
    def grad_norms(self) -> list[float | None]:
        """Each stage's clipped gradient norm at the last committed step (CheckFree weights)."""
        return list(self.ledger.grad_norms.norms)

    @property
    def timings(self) -> dict[str, list[float]]:
        """Seconds the job was blocked, per kind of work (checkpoint and snapshot writes)."""
        return self.persistence.timings

    def infos(self) -> dict[int, WorkerInfo]:
        """Where each live worker runs."""
        assert self.group is not None
        return {rank: self.group.info(rank) for rank in self.group.ranks()}

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
        self.layout.validate(self.config.backend)
        if self.group is None:
            from recovery.runtime.ray_group import RayWorkerGroup

            self.started_ray = connect()
            self._host = "127.0.0.1" if self.started_ray else driver_host()
            self.group = RayWorkerGroup(
                self.layout.worker_cls,
                threads=self.config.threads_per_worker,
                backend=self.config.backend,
                options=self.config.worker_options,
            )
        self._store = host_store(self._host)
        self.job_nodes = self.group.nodes()
        for fault in self.failures:
            if isinstance(fault, KillNode) and fault.node >= len(self.job_nodes):
                raise ValueError(f"{fault}: the job runs on {len(self.job_nodes)} node(s)")
        self.persistence = Persistence(
            self.group,
            self.spec,
            self.topology,
            self.policy,
            self.ledger,
            snapshot_dir=self.config.snapshot_dir,
            work_dir=self.config.work_dir,
        )
        self.assignment = place(self.topology, self.job_nodes)
        self._add_spares(self.policy.hot_spares)
        self._start_workers(self.assignment, parked=True, what="start workers")
        # Spares are ready before the first step: a spare still importing torch is no spare.
        ready = self.group.await_spares(self.policy.timeouts.start)
        if ready < self.policy.hot_spares:
            log.warning(
                "%d hot spare(s) failed to start; continuing without them",
                self.policy.hot_spares - ready,
            )
        self.form_generation()
        if self.policy.snapshots.durable_every is not None:
            self.resumed_from = self.persistence.open_durable(resume=self.config.resume)
            if self.resumed_from is not None:
                self.step = self.resumed_from
        self.layout.seed_mirrors(
            self.group, None, {}, self.ledger.ring, self.policy.timeouts.transfer
        )
        self.started_at = time.perf_counter()
        self.started_wall = time.time()
        self.phase = Phase.RUNNING

    def _start_workers(
        self, placement: dict[int, str], *, what: str, spares: bool = False, parked: bool = False
    ) -> set[int]:
        """Start workers for ``placement`` and set them up. Returns the ranks that got a
        warm worker (a hot spare, or one parked by an earlier job)."""
        assert self.group is not None
        started, warm = self.group.start(
            placement, timeout=self.policy.timeouts.start, spares=spares, parked=parked
        )
        if started.lost:
            raise RecoveryError(started.describe(what))
        for rank, info in started.results.items():
            self.assignment[rank] = info.node_id or placement[rank]
            self._hosts[rank] = info.host
        backend = self.config.backend
        built = self.group.call(
            "setup",
            placement,
            lambda rank: self.layout.setup_args(rank, backend),
            timeout=self.policy.timeouts.start,
        )
        if built.lost:
            raise RecoveryError(built.describe("build stages"))
        return warm

    def _add_spares(self, count: int) -> None:
        assert self.group is not None
        nodes = [n for n in self.job_nodes if n not in self.lost_nodes] or self.job_nodes
        first = self.group.spare_count()
        picks = [nodes[(first + i) % len(nodes)] for i in range(max(0, count))]
        warm = ("warm", (self.spec, self.topology, self.config.backend))
        self.group.add_spares(picks, lambda: warm)

    def form_generation(self) -> float:
        """Tear down the current process groups everywhere and form the next generation.

        Returns the seconds it took. Every generation meets on a fresh key prefix of the
        controller's store, so nothing from an older generation is ever read again.
        """
        assert self.group is not None
        start = time.perf_counter()
        self.generation += 1
        timeout = self.policy.timeouts.join
        rendezvous = Rendezvous(
            self._host, self._store.port, f"gen{self.generation}", seconds(timeout)
        )
        peer = bool(self.policy.snapshots.peer_every) and self.topology.world_size > 1
        mirrors = self.layout.mirrors_on_ring and self.topology.world_size > 1
        ring = buddies(self.topology, self.assignment) if peer or mirrors else {}
        self.ledger.ring = ring
        wards = {buddy: ward for ward, buddy in ring.items()}
        joined = self.group.call(
            "join",
            range(self.topology.world_size),
            lambda rank: (
                self.generation,
                rendezvous,
                self._hosts.get(rank, "127.0.0.1"),
                peer,
                ring.get(rank),
                wards.get(rank),
            ),
            timeout=seconds(timeout) + 10,
        )
        if joined.lost:
            raise RecoveryError(joined.describe(f"form generation {self.generation}"))
        return time.perf_counter() - start

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
                    self._finish_event(resumed=False)  # a recovery after the last commit
                    self.phase = Phase.FINISHED
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
        except RecoveryError as exc:
            log.error("%s", exc)
            self.error = exc
            self.phase = Phase.FAILED
        return self.phase

    # -- one step ------------------------------------------------------------------------

    def _faults_for(self, step: int) -> dict[int, tuple[Fault, ...]]:
        """The injected faults that strike at ``step``, per rank (each fires once)."""
        out: dict[int, list[Fault]] = {}
        for fault in self.failures:
            if fault.step != step or fault in self._fired:
                continue
            if isinstance(fault, KillNode):
                node = self.job_nodes[fault.node]
                self.lost_nodes.add(node)
                for rank, on in self.assignment.items():
                    if on == node:
                        w = self.topology.worker(rank)
                        out.setdefault(rank, []).append(
                            Kill(step=step, stage=w.stage, replica=w.replica)
                        )
                self._fired.add(fault)
            elif isinstance(fault, WorkerFault):
                out.setdefault(self.topology.rank(fault.stage, fault.replica), []).append(fault)
        return {rank: tuple(faults) for rank, faults in out.items()}

    def _train_step(self) -> None:
        assert self.group is not None
        step = self.step
        start = time.perf_counter()
        struck_at = time.time()
        faults = self._faults_for(step)
        everyone = range(self.topology.world_size)  # a rank without a worker is lost
        calls = {r: self.group.submit(r, "run_step", step, faults.get(r, ())) for r in everyone}
        outcome = await_step(self.group, calls, self.policy.timeouts.hang)
        if not outcome.ok:
            self._fail(step, outcome, struck_at, faults)
            return
        self.persistence.note(outcome.reports)
        bad = non_finite(outcome.reports)
        if bad:  # silent corruption shows up as NaN/inf: never commit it
            self._mark_fired(faults)
            numerical = StepOutcome(reports={r: outcome.reports[r] for r in bad})
            self._fail(step, numerical, struck_at, faults, numerical=bad)
            return
        commits = self.group.call(
            "commit", args=lambda r: (step,), timeout=self.policy.timeouts.hang
        )
        record = step_record(
            self.topology,
            step,
            outcome.reports,
            elapsed=time.perf_counter() - start,
            since_start=time.perf_counter() - self.started_at,
            tokens_per_step=self.tokens_per_step,
            generation=self.generation,
        )
        self.ledger.note_norms(record.grad_norms)
        self.step = step + 1
        if commits.lost:  # died while applying: the step is committed for everyone else
            self.records.append(record)
            self.on_step(record)
            self._fail(self.step, StepOutcome(lost=commits.lost), struck_at, faults)
            return
        self._mark_fired(faults)
        self.persistence.after_commit(self.step)
        if self.config.eval_every and (
            self.step % self.config.eval_every == 0 or self.step == self.target_steps
        ):
            record.val_loss = self.evaluate()
        self.records.append(record)
        self.on_step(record)
        self._finish_event()

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
            calls = {
                r: self.group.submit(r, "evaluate", index) for r in range(self.topology.world_size)
            }
            outcome = await_step(self.group, calls, self.policy.timeouts.hang)
            if not outcome.ok:
                self._fail(self.step, outcome, struck_at, {})
                return None
            total += sum(r.stats.loss_sum for r in outcome.reports.values())
            count += sum(r.stats.losses for r in outcome.reports.values())
        return total / count if count else math.nan

    def _fail(
        self,
        step: int,
        outcome: StepOutcome,
        struck_at: float,
        faults: dict[int, tuple[Fault, ...]],
        *,
        numerical: dict[int, str] | None = None,
    ) -> None:
        lost = set(outcome.lost)
        messages = {rank: f"{type(e).__name__}: {e.reason}" for rank, e in outcome.lost.items()}
        messages.update(numerical or outcome.failed)
        injected = self._injected_time(lost | set(messages))
        if numerical:
            cause = "numerical fault"
        elif outcome.hung:
            cause = "hung"
        elif any(self.assignment.get(r) in self.lost_nodes for r in lost):
            cause = "node lost"
        elif lost:
            cause = "killed"
        else:
            cause = "communication error"
        self._mark_fired(faults, lost | outcome.hung)
        self._failure = Failure(
            step=step,
            lost=lost,
            cause=cause,
            detected_at=time.time(),
            struck_at=injected if injected is not None else struck_at,
            errors=messages,
            generation=self.generation,
            numerical=bool(numerical),
        )
        log.warning(
            "step %d failed (%s): lost %s",
            step,
            cause,
            ", ".join(str(self.topology.worker(r)) for r in sorted(lost)) or "nobody",
        )
        self.phase = Phase.RECOVERING

    def _mark_fired(
        self, faults: dict[int, tuple[Fault, ...]], ranks: set[int] | None = None
    ) -> None:
        """Faults fire once: mark those of ``ranks`` (default: all) as spent."""
        for rank, fs in faults.items():
            if ranks is None or rank in ranks:
                self._fired.update(fs)

    def _injected_time(self, ranks: set[int]) -> float | None:
        """When an injected fault struck one of ``ranks`` (workers leave it in the store)."""
        store = dist.PrefixStore(f"gen{self.generation}", self._store)
        times = []
        for rank in ranks:
            key = f"fault/{rank}"
            with contextlib.suppress(Exception):
                if store.check([key]):
                    times.append(float(store.get(key).decode()))
        return min(times) if times else None

    # -- recovery, one phase per transition ----------------------------------------------

    def _plan_recovery(self) -> None:
        """RECOVERING: survivors abandon the step and leave; the planner decides."""
        assert self.group is not None and self._failure is not None
        failure = self._failure
        if (
            self.policy.max_recoveries is not None
            and len(self.events) >= self.policy.max_recoveries
        ):
            raise RecoveryError(
                f"{failure.describe(self.topology)}\nmax_recoveries={self.policy.max_recoveries} reached"
            )
        lost = set(failure.lost)
        self.group.kill(lost)
        # Survivors abandon the step and leave the generation; anyone dying now is lost too.
        survivors = [r for r in self.group.ranks() if r not in lost]
        prepared = self.group.call(
            "prepare_recovery", survivors, timeout=self.policy.timeouts.control
        )
        lost |= set(prepared.lost)
        self.group.kill(prepared.lost)
        self.persistence.note({r: rep for r, rep in prepared.results.items() if r not in lost})
        self.persistence.commit_landed()
        alive = {rank: rep.step for rank, rep in prepared.results.items() if rank not in lost}
        assessed = (
            {}
            if failure.numerical
            else self.layout.assess(
                self.group, lost, alive, self.ledger.ring, self.policy.timeouts.control
            )
        )
        self.ledger.forget(lost)
        self._recovery = _Recovery(
            failure, lost, alive, assessed, self._plan(failure, lost, alive, assessed)
        )
        log.info("%s", self._recovery.plan.describe(self.topology))
        self.phase = Phase.REPLACING

    def _plan(
        self,
        failure: Failure,
        lost: set[int],
        alive: dict[int, int],
        assessed: dict[int, dict[str, int]],
    ) -> RecoveryPlan:
        redundancy = self.ledger.redundancy(
            alive,
            mirror_holder=self.layout.mirror_holders(self.ledger.ring),
            mirror_stale={r: a["rows_stale"] > 0 for r, a in assessed.items()},
            pls=self.layout.pls(alive, assessed),
        )
        try:
            return plan(
                self.topology, lost, redundancy, self.policy, rollback_all=failure.numerical
            )
        except RedundancyExhausted as exc:
            raise RedundancyExhausted(f"{failure.describe(self.topology)}\n{exc}") from None

    def _replace(self) -> None:
        """REPLACING: new processes for the lost workers; survivors restore in place --
        except in the restart baseline, where everyone goes and comes back cold."""
        assert self.group is not None and self._recovery is not None
        rec = self._recovery
        t0 = time.perf_counter()
        rebuild = sorted(rec.lost)
        cold = rec.plan.strategy == Strategy.RESTART
        if cold:
            rebuild = list(range(self.topology.world_size))
            self.group.kill(rec.alive)
        alive_now = [
            n for n in self.group.nodes() if n not in self.lost_nodes
        ] or self.group.nodes()
        placement = {
            r: replacement_node(self.topology, r, self.assignment, alive_now) for r in rebuild
        }
        rec.warm = self._start_workers(placement, spares=not cold, what="start replacement workers")
        if not cold:
            self._add_spares(self.policy.hot_spares - self.group.spare_count())
        rec.breakdown["replace"] = time.perf_counter() - t0
        self.phase = Phase.REFORMING

    def _reform(self) -> None:
        """REFORMING: the next generation's process groups, on a fresh store prefix."""
        assert self._recovery is not None
        self._recovery.ring_before = dict(self.ledger.ring)
        self._recovery.breakdown["reform"] = self.form_generation()
        self.phase = Phase.RESTORING

    def _restore(self) -> None:
        """RESTORING: the plan's transfers, then the shard mirrors; resume training."""
        assert self.group is not None and self._recovery is not None
        rec = self._recovery
        t0 = time.perf_counter()
        ctx = Restore(
            group=self.group,
            topology=self.topology,
            spec=self.spec,
            policy=self.policy,
            ledger=self.ledger,
            timeout=self.policy.timeouts.transfer,
            durable=self.persistence.durable,
            snapshot_dir=self.config.snapshot_dir,
            checkpoint_dir=self.persistence.checkpoint_dir,
        )
        while True:
            try:
                moved = execute(ctx, rec.plan)
                break
            except SnapshotCorrupted as exc:  # never load it; fall back to an older snapshot
                log.warning(
                    "durable snapshot of step %d is corrupted: %s", rec.plan.resume_step, exc
                )
                self.ledger.durable_steps.remove(rec.plan.resume_step)
                rec.plan = self._plan(rec.failure, rec.lost, rec.alive, rec.assessed)
        moved += self.layout.seed_mirrors(
            self.group, rec.plan, rec.ring_before, self.ledger.ring, self.policy.timeouts.transfer
        )
        embedding = self.layout.account(rec.plan, rec.alive, rec.assessed)
        rec.breakdown["transfer"] = time.perf_counter() - t0
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
        )
        self._pending_event = (event, time.time())
        self._failure = self._recovery = None
        self.step = rec.plan.resume_step
        self.phase = Phase.RUNNING

    def _finish_event(self, *, resumed: bool = True) -> None:
        """After the first commit following a recovery, close and publish its event.

        ``resumed=False``: the job ended with the recovery (no step left to resume).
        """
        if self._pending_event is None:
            return
        event, recovered_at = self._pending_event
        self._pending_event = None
        event.breakdown["resume"] = time.time() - recovered_at if resumed else 0.0
        event.seconds = sum(event.breakdown.values())
        self.events.append(event)
        self.on_event(event)

    # -- results and shutdown ------------------------------------------------------------

    def states(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Every worker's final state, keyed by (stage, replica).

        Raises:
            RecoveryError: if a worker is lost while its state is read.
        """
        assert self.group is not None
        self.layout.before_states(self.group, self.policy.timeouts.transfer)
        got = self.group.call("state", timeout=self.policy.timeouts.transfer)
        if got.lost:
            raise RecoveryError(got.describe("collect states"))
        return {
            (self.topology.worker(rank).stage, self.topology.worker(rank).replica): state
            for rank, state in got.results.items()
        }

    def mirror_costs(self) -> dict[str, float]:
        """What the layout's redundancy costs per worker (embedding mirrors); empty: nothing."""
        if self.group is None or not self.group.ranks():
            return {}
        return self.layout.costs(self.group, self.policy.timeouts.control)

    def shutdown(self) -> None:
        """Release every worker (parked for reuse after a clean finish); drop the store."""
        if self.group is not None:
            self.group.shutdown(clean=self.phase is Phase.FINISHED)
        self._store = None
