"""The controller: owns membership, hosts the store, drives steps, detects and recovers failures.

It runs in the driver process (the one that calls `Trainer.fit`), never on a worker, so
losing any worker never loses the store or the job's bookkeeping. It is an explicit state
machine (`Phase`); `advance` performs exactly one transition, which is what tests drive.

    STARTING --start()--> RUNNING --step ok--> RUNNING --all steps--> FINISHED
                             |  ^
                     failure |  | recovered
                             v  |
                          RECOVERING --no way out--> FAILED

[Note: failure detection]
A step's failure shows up in one of three ways, and the controller waits for all of them
at once with ``ray.wait``: a dead worker's call raises ``RayActorError`` (Ray notices the
process exit); a survivor's call returns a failed `StepReport` (Gloo reported the dead peer,
and the survivor tore down its groups so that its own peers fail fast too -- see
``parallelism/comm.py``); or nothing returns within ``hang_timeout_s``. In the last case
the controller asks each silent worker, on a separate control thread, what it is doing;
those not blocked on a peer are the hung ones. It kills them, which turns the hang into
the first case. A failure before the commit decision abandons the step everywhere; a
worker that dies after it (while applying the step) leaves the step committed for everyone
else, and its replacement copies the committed state.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from parallelism.comm import Rendezvous, host_store
from parallelism.topology import Topology
from recovery.errors import RecoveryError, RedundancyExhausted, SnapshotCorrupted
from recovery.events import RecoveryEvent
from recovery.faults import FailureSchedule, Fault, Kill, KillNode, WorkerFault
from recovery.names import Strategy, Tier
from recovery.placement import place, replacement_node
from recovery.planner import RecoveryAction as Action
from recovery.planner import RecoveryPlan, Redundancy, plan
from recovery.policy import RecoveryPolicy
from recovery.pool import POOL
from recovery.ray_env import alive_nodes, connect, driver_host
from recovery.snapshots import DurableStore, buddies
from recovery.spec import TrainSpec
from recovery.table_worker import TableWorker
from recovery.worker import StageWorker, StepReport, WorkerInfo

log = logging.getLogger("checkfree")


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"


class _RemoteWorker(StageWorker):
    """`StageWorker` as a Ray actor; `probe` and `abort` run on a separate control thread,
    so they are answered while the worker is busy (or stuck) in a step."""

    @ray.method(concurrency_group="control")
    def probe(self) -> dict[str, object]:  # type: ignore[override]
        return StageWorker.probe(self)

    @ray.method(concurrency_group="control")
    def abort(self) -> None:  # type: ignore[override]
        StageWorker.abort(self)


class _RemoteTableWorker(TableWorker):
    """`TableWorker` as a Ray actor, with the same control thread as `_RemoteWorker`."""

    @ray.method(concurrency_group="control")
    def probe(self) -> dict[str, object]:  # type: ignore[override]
        return StageWorker.probe(self)

    @ray.method(concurrency_group="control")
    def abort(self) -> None:  # type: ignore[override]
        StageWorker.abort(self)


_REMOTE_WORKER = ray.remote(concurrency_groups={"control": 1})(_RemoteWorker)  # type: ignore[call-overload]
_REMOTE_TABLE_WORKER = ray.remote(concurrency_groups={"control": 1})(_RemoteTableWorker)  # type: ignore[call-overload]


@dataclass
class Member:
    """A live worker of the current generation."""

    rank: int
    actor: Any
    info: WorkerInfo


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


@dataclass
class ControllerConfig:
    """How the controller runs the job (set by `Trainer`)."""

    backend: str
    threads_per_worker: int = 1
    eval_every: int = 0
    eval_batches: int = 1
    start_timeout_s: float = 300.0
    join_timeout_s: float = 60.0
    work_dir: str | None = None
    """Where the restart baseline writes checkpoints (default: a temp folder)."""
    snapshot_dir: str | None = None
    """Where durable snapshots go (required when the policy sets ``durable_every``)."""
    resume: bool = True
    """Resume from the newest intact durable snapshot in ``snapshot_dir``, if one exists."""
    worker_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Failure:
    """A failed step, as detected."""

    step: int
    lost: set[int]
    cause: str
    detected_at: float
    struck_at: float
    errors: dict[int, str]
    numerical: bool = False
    """A non-finite loss or gradient norm: the live state itself is suspect."""


class Controller:
    """Drives one training job on Ray. See the module docstring for the state machine."""

    def __init__(
        self,
        spec: TrainSpec,
        topology: Topology,
        config: ControllerConfig,
        *,
        policy: RecoveryPolicy | None = None,
        failures: FailureSchedule | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        on_event: Callable[[RecoveryEvent], None] | None = None,
    ) -> None:
        self.spec = spec
        self.topology = topology
        self.config = config
        self.policy = policy or RecoveryPolicy()
        self.failures = failures or FailureSchedule()
        self.on_step = on_step or (lambda record: None)
        self.on_event = on_event or (lambda event: None)
        self.phase = Phase.STARTING
        self.generation = -1
        self.step = 0
        self.target_steps = 0
        self.members: dict[int, Member] = {}
        self.assignment: dict[int, str] = {}
        self.job_nodes: list[str] = []
        self.lost_nodes: set[str] = set()
        self.records: list[StepRecord] = []
        self.events: list[RecoveryEvent] = []
        self.tokens_per_step = 0
        self.started_at = time.perf_counter()
        self.started_wall = time.time()
        self.started_ray = False
        self._store: Any = None
        self.host = "127.0.0.1"
        self.error: BaseException | None = None
        self._fired: set[Fault] = set()
        self._failure: _Failure | None = None
        self._pending_event: tuple[RecoveryEvent, float] | None = None
        self._spares: list[tuple[Any, str]] = []
        self.checkpoint_steps: list[int] = []
        self._checkpoint_dir = ""
        self.holdings: dict[int, dict[int, list[int]]] = {}
        """Rank -> the peer snapshots it holds (rank -> steps), as last reported."""
        self.durable: DurableStore | None = None
        self.durable_steps: list[int] = []
        self._durable_done: dict[int, set[int]] = {}
        self.resumed_from: int | None = None
        self.ring: dict[int, int] = {}
        """Rank -> its buddy in the current generation: the holder of its peer snapshots
        and (embedding tables) of its shard mirror."""
        self._accepted: list[tuple[int, float]] = []
        """Embedding tables: (committed steps, lost samples) of every partial restore on
        the current timeline (for the job's PLS)."""
        self.grad_norms: list[float | None] = [None] * topology.stages
        """Each stage's clipped gradient norm at the last committed step (CheckFree weights)."""
        self.timings: dict[str, list[float]] = {}
        """Seconds the job was blocked, per kind of work (checkpoint and snapshot writes)."""

    # -- startup -------------------------------------------------------------------------

    def start(self) -> None:
        """Connect to Ray, host the store, start and set up every worker, form generation 0."""
        assert self.phase is Phase.STARTING
        self.tokens_per_step = self.spec.check(self.topology)
        if self.spec.tables is not None and self.config.backend != "gloo":
            raise ValueError(
                f"sharded embedding tables train on the CPU over Gloo, not {self.config.backend!r}"
            )
        if self.spec.shard_optimizer and self.policy.approximate and not self.policy.exact_only:
            raise ValueError(
                "shard_optimizer (ZeRO-1) does not combine with approximate (CheckFree) "
                "recovery: a rebuilt stage has no optimizer shards to average"
            )
        self.started_ray = connect()
        self.host = "127.0.0.1" if self.started_ray else driver_host()
        self._store = host_store(self.host)
        self.job_nodes = alive_nodes()
        for fault in self.failures:
            if isinstance(fault, KillNode) and fault.node >= len(self.job_nodes):
                raise ValueError(f"{fault}: the job runs on {len(self.job_nodes)} node(s)")
        if self.policy.strategy == Strategy.RESTART:
            self._checkpoint_dir = str(
                self.policy.checkpoint_dir
                or self.config.work_dir
                or tempfile.mkdtemp(prefix="checkfree-ckpt-")
            )
        self.assignment = place(self.topology, self.job_nodes)
        warming = self._start_spares(self.policy.hot_spares)
        self.members = self._start_workers(self.assignment)
        self._call(
            {rank: m.actor for rank, m in self.members.items()},
            "setup",
            self._setup_args,
            timeout_s=self.config.start_timeout_s,
            what="build stages",
        )
        # Spares are ready before the first step: a spare still importing torch is no spare.
        _, failed = self._gather(warming, self.config.start_timeout_s)
        if failed:
            log.warning("%d hot spare(s) failed to start; continuing without them", len(failed))
            self._spares = [sp for i, sp in enumerate(self._spares) if i not in failed]
        self.form_generation()
        if self.policy.durable_every is not None:
            self._open_durable()
        self._seed_mirrors()
        self.started_at = time.perf_counter()
        self.started_wall = time.time()
        self.phase = Phase.RUNNING

    def _durable_meta(self) -> dict[str, Any]:
        """What identifies this job in a durable snapshot: a re-run must match it to resume."""
        return {
            "topology": [self.topology.stages, self.topology.replicas],
            "spec": self.spec.name,
            "seed": self.spec.seed,
            "microbatches": self.spec.microbatches,
        }

    def _open_durable(self) -> None:
        """Open the durable tier; after a driver death, resume from its newest intact snapshot.

        Raises:
            ValueError: if there is no snapshot folder, or its snapshots belong to another job.
        """
        if not self.config.snapshot_dir:
            raise ValueError(
                "durable_every needs a snapshot folder: set snapshot_dir or a run folder"
            )
        self.durable = DurableStore(self.config.snapshot_dir)
        if not self.config.resume:
            return
        for step in self.durable.steps():
            problems = self.durable.verify(step, self.topology.world_size)
            if problems:
                log.warning(
                    "durable snapshot of step %d is not intact, skipping it: %s",
                    step,
                    "; ".join(problems),
                )
                continue
            self.durable.check_meta(step, self._durable_meta())
            try:
                self._call(
                    {rank: m.actor for rank, m in self.members.items()},
                    "durable_load",
                    lambda rank, step=step: (self.config.snapshot_dir, step),  # type: ignore[misc]
                    timeout_s=self.config.start_timeout_s,
                    what=f"resume from the durable snapshot of step {step}",
                )
            except SnapshotCorrupted as exc:
                log.warning(
                    "durable snapshot of step %d is corrupted, trying an older one: %s", step, exc
                )
                continue
            self.durable.discard_after(step)
            self.durable_steps = [s for s in self.durable.steps() if s <= step]
            self.step = self.resumed_from = step
            log.warning(
                "resumed from the durable snapshot of step %d in %s", step, self.config.snapshot_dir
            )
            return
        if self.durable.steps():
            raise RecoveryError(
                f"no intact durable snapshot in {self.config.snapshot_dir} (every complete one failed "
                "its checksums, see the log); move the folder away to start from scratch"
            )

    def _setup_args(self, rank: int) -> tuple[Any, ...]:
        args = (self.spec, self.topology, rank, self.config.backend)
        return (*args, self.policy.mirror_plan) if self.spec.tables is not None else args

    @property
    def _pool_key(self) -> tuple[Any, ...]:
        return (
            self.spec.tables is not None,
            self.config.threads_per_worker,
            self.config.backend,
            tuple(sorted(self.config.worker_options.items())),
        )

    def _new_actor(self, node_id: str) -> Any:
        options: dict[str, Any] = {
            "num_cpus": 0,
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        if self.config.backend == "nccl":
            options["num_gpus"] = 1  # Ray sets CUDA_VISIBLE_DEVICES: the worker's GPU is cuda:0
        options.update(self.config.worker_options)
        if node_id:
            # Hard affinity: placement is a correctness property (see recovery/placement.py).
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id, soft=False, _fail_on_unavailable=True
            )
        remote = _REMOTE_TABLE_WORKER if self.spec.tables is not None else _REMOTE_WORKER
        return remote.options(**options).remote(self.config.threads_per_worker)

    def _start_workers(self, assignment: dict[int, str], *, warm: bool = True) -> dict[int, Member]:
        """Start (or take warm from the pool, if ``warm``) one actor per rank on its node."""
        actors: dict[int, Any] = {}
        pooled: set[int] = set()
        for rank, node in assignment.items():
            actor = POOL.take(node, self._pool_key) if warm else None
            if actor is None:
                actor = self._new_actor(node)
            else:
                pooled.add(rank)
            actors[rank] = actor
        refs = {rank: actor.info.remote() for rank, actor in actors.items()}
        infos, errors = self._gather(refs, self.config.start_timeout_s)
        stale = {rank for rank in errors if rank in pooled}
        if stale:  # parked actors that died meanwhile: start fresh ones instead
            for rank in stale:
                actors[rank] = self._new_actor(assignment[rank])
            retry = {rank: actors[rank].info.remote() for rank in stale}
            more, errors = self._gather(retry, self.config.start_timeout_s)
            infos.update(more)
        if errors:
            raise RecoveryError(_describe_errors("start workers", errors))
        return {rank: Member(rank, actors[rank], infos[rank]) for rank in actors}

    def _start_spares(self, count: int) -> dict[int, Any]:
        """Start ``count`` hot spares (spread over nodes) and warm them up, without waiting.

        Returns the warm-up calls, keyed by index in ``self._spares``.
        """
        nodes = [n for n in self.job_nodes if n not in self.lost_nodes] or self.job_nodes
        refs: dict[int, Any] = {}
        for _ in range(max(0, count)):
            node = nodes[len(self._spares) % len(nodes)]
            actor = POOL.take(node, self._pool_key) or self._new_actor(node)
            refs[len(self._spares)] = actor.warm.remote(
                self.spec, self.topology, self.config.backend
            )
            self._spares.append((actor, node))
        return refs

    def form_generation(self) -> float:
        """Tear down the current process groups everywhere and form the next generation.

        Returns the seconds it took. Every generation meets on a fresh key prefix of the
        controller's store, so nothing from an older generation is ever read again.
        """
        start = time.perf_counter()
        self.generation += 1
        rendezvous = Rendezvous(
            self.host, self._store.port, f"gen{self.generation}", self.config.join_timeout_s
        )
        peer = bool(self.policy.snapshot_every) and self.topology.world_size > 1
        mirrors = self.spec.tables is not None and self.topology.world_size > 1
        ring = (
            buddies(self.topology, {r: m.info.node_id for r, m in self.members.items()})
            if peer or mirrors
            else {}
        )
        self.ring = ring
        wards = {buddy: ward for ward, buddy in ring.items()}
        self._call(
            {rank: m.actor for rank, m in self.members.items()},
            "join",
            lambda rank: (
                self.generation,
                rendezvous,
                self.members[rank].info.host,
                peer,
                ring.get(rank),
                wards.get(rank),
            ),
            timeout_s=self.config.join_timeout_s + 10,
            what=f"form generation {self.generation}",
        )
        return time.perf_counter() - start

    # -- the state machine ---------------------------------------------------------------

    def run(self, steps: int) -> None:
        """Advance until ``steps`` steps are committed (or the job fails)."""
        self.target_steps = steps
        if self.phase is Phase.STARTING:
            self.start()
        while self.phase not in (Phase.FINISHED, Phase.FAILED):
            self.advance()
        if self.phase is Phase.FINISHED and self.durable is not None:
            # The last durable writes may still be in flight: let them land and mark them
            # complete, so that a re-run with more steps resumes from the end of this one.
            refs = {rank: m.actor.flush_snapshots.remote() for rank, m in self.members.items()}
            reports, _ = self._gather(refs, self.config.start_timeout_s)
            self._note_redundancy(reports)
        if self.phase is Phase.FAILED:
            assert self.error is not None
            raise self.error

    def advance(self) -> Phase:
        """Perform one transition of the state machine and return the new phase."""
        if self.phase is Phase.RUNNING:
            if self.step >= self.target_steps:
                self._finish_event(resumed=False)  # a recovery after the last commit
                self.phase = Phase.FINISHED
            else:
                self._train_step()
        elif self.phase is Phase.RECOVERING:
            try:
                self._recover()
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
                for rank, m in self.members.items():
                    if m.info.node_id == node:
                        out.setdefault(rank, []).append(
                            Kill(
                                step=step,
                                stage=self.topology.worker(rank).stage,
                                replica=self.topology.worker(rank).replica,
                            )
                        )
                self._fired.add(fault)
            elif isinstance(fault, WorkerFault):
                out.setdefault(self.topology.rank(fault.stage, fault.replica), []).append(fault)
        return {rank: tuple(faults) for rank, faults in out.items()}

    def _train_step(self) -> None:
        step = self.step
        start = time.perf_counter()
        struck_at = time.time()
        faults = self._faults_for(step)
        actors = {rank: m.actor for rank, m in self.members.items()}
        refs = {rank: a.run_step.remote(step, faults.get(rank, ())) for rank, a in actors.items()}
        reports, errors, hung = self._await_step(refs)
        failed = {rank: r.error for rank, r in reports.items() if not r.ok}
        if errors or failed:
            self._fail(step, set(errors), failed, errors, hung, struck_at, faults)
            return
        self._note_redundancy(reports)
        bad = _non_finite(reports)
        if bad:  # silent corruption shows up as NaN/inf: never commit it
            self._mark_fired(faults)
            self._fail(step, set(), bad, {}, set(), struck_at, faults, numerical=True)
            return
        _commits, errors = self._gather(
            {rank: a.commit.remote(step) for rank, a in actors.items()}, self.policy.hang_timeout_s
        )
        elapsed = time.perf_counter() - start
        record = self._record(step, reports, elapsed)
        self.grad_norms = list(record.grad_norms)
        self.step = step + 1
        if errors:  # died while applying: the step is committed for everyone else
            self.records.append(record)
            self.on_step(record)
            self._fail(self.step, set(errors), {}, errors, set(), struck_at, faults)
            return
        self._mark_fired(faults)
        if self.policy.strategy == Strategy.RESTART and self.step % self.policy.checkpoint_every == 0:
            self._save_checkpoint()
        self._take_snapshots()
        if self.config.eval_every and (
            self.step % self.config.eval_every == 0 or self.step == self.target_steps
        ):
            record.val_loss = self.evaluate()
        self.records.append(record)
        self.on_step(record)
        self._finish_event()

    def _await_step(
        self, refs: dict[int, Any]
    ) -> tuple[dict[int, StepReport], dict[int, BaseException], set[int]]:
        """Wait for a step's reports; kill hung workers (see [Note: failure detection])."""
        pending = list(refs.values())
        not_ready = self._wait_or_abort(refs, self.policy.hang_timeout_s)
        hung: set[int] = set()
        if not_ready:
            silent = [rank for rank, ref in refs.items() if ref in not_ready]
            hung = self._find_hung(silent)
            for rank in hung:
                log.warning(
                    "worker %s made no progress for %.0f s: killing it",
                    self.topology.worker(rank),
                    self.policy.hang_timeout_s,
                )
                with contextlib.suppress(Exception):
                    ray.kill(self.members[rank].actor, no_restart=True)
            _, not_ready = ray.wait(
                pending, num_returns=len(pending), timeout=min(60.0, self.policy.hang_timeout_s)
            )
            for rank, ref in refs.items():  # still silent after the cascade: give up on them too
                if ref in not_ready:
                    hung.add(rank)
                    with contextlib.suppress(Exception):
                        ray.kill(self.members[rank].actor, no_restart=True)
        results, errors = self._gather(refs, 10.0)
        return results, errors, hung

    def _wait_or_abort(self, refs: dict[int, Any], timeout_s: float) -> list[Any]:
        """Wait for every ref; at the first sign of failure, tell the rest to abort the step.

        Without the abort, a survivor that is not connected to the dead worker would only
        notice when the failure reaches it through the schedule -- e.g. a whole healthy
        pipeline computing on until the gradient all-reduce. Returns the refs not ready.
        """
        waiting = dict(refs)
        deadline = time.monotonic() + timeout_s
        aborted = False
        while waiting:
            ready, _ = ray.wait(
                list(waiting.values()), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                break
            for rank in [r for r, ref in waiting.items() if ref in ready]:
                ref = waiting.pop(rank)
                if not aborted and not _succeeded(ref):
                    aborted = True
                    for other in waiting:
                        self.members[other].actor.abort.remote()
        return list(waiting.values())

    def _find_hung(self, silent: list[int]) -> set[int]:
        """Among silent workers, those not blocked on a peer (all of them if none stands out)."""
        probes = {rank: self.members[rank].actor.probe.remote() for rank in silent}
        answers, errors = self._gather(probes, 5.0)
        hung = set(errors) | {rank for rank, a in answers.items() if a.get("waiting_on") is None}
        return hung or set(silent)

    def _fail(
        self,
        step: int,
        lost: set[int],
        failed: dict[int, str],
        errors: dict[int, BaseException],
        hung: set[int],
        struck_at: float,
        faults: dict[int, tuple[Fault, ...]],
        *,
        numerical: bool = False,
    ) -> None:
        detected_at = time.time()
        injected = self._injected_time(lost | set(failed))
        messages = {rank: _first_line(e) for rank, e in errors.items()}
        messages.update(failed)
        if numerical:
            cause = "numerical fault"
        elif hung:
            cause = "hung"
        elif any(self.members[r].info.node_id in self.lost_nodes for r in lost):
            cause = "node lost"
        elif lost:
            cause = "killed"
        else:
            cause = "communication error"
        self._mark_fired(faults, lost | hung)
        self._failure = _Failure(
            step=step,
            lost=lost,
            cause=cause,
            detected_at=detected_at,
            struck_at=injected if injected is not None else struck_at,
            errors=messages,
            numerical=numerical,
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

    # -- snapshots -----------------------------------------------------------------------

    def _note_redundancy(self, reports: dict[int, StepReport]) -> None:
        """Record what the workers hold: peer snapshots, finished durable writes."""
        for rank, report in reports.items():
            self.holdings[rank] = report.snapshots
            for step in report.durable_done:
                self._durable_done.setdefault(step, set()).add(rank)
        if self.durable is None:
            return
        for step in sorted(self._durable_done):
            if len(self._durable_done[step]) == self.topology.world_size:
                del self._durable_done[step]
                self.durable.commit(step, self.topology.world_size, self._durable_meta())
                self.durable_steps.append(step)
                removed = self.durable.prune(self.policy.keep_durable, checksums=False)
                self.durable_steps = [s for s in self.durable_steps if s not in removed]

    def _commit_landed_durable(self) -> None:
        """Mark complete the durable snapshots whose every rank's files are on disk.

        A worker that died after its write landed never reported it; its manifest (renamed
        into place only when the write was whole) is the proof instead.
        """
        if self.durable is None:
            return
        for step in sorted(self._durable_done):
            with contextlib.suppress(FileNotFoundError):
                self.durable.commit(step, self.topology.world_size, self._durable_meta())
                del self._durable_done[step]
                self.durable_steps.append(step)

    def _take_snapshots(self) -> None:
        """Start the snapshots due after this commit (see recovery/snapshots.py)."""
        actors = {rank: m.actor for rank, m in self.members.items()}
        every = self.policy.snapshot_every
        if every and self.topology.world_size > 1 and self.step % every == 0:
            start = time.perf_counter()
            self._call(
                actors,
                "take_snapshot",
                lambda rank: (self.step,),
                timeout_s=self.policy.hang_timeout_s,
                what="take peer snapshots",
            )
            self._timed("snapshot_write", start)
        every = self.policy.durable_every
        if (
            every
            and self.durable is not None
            and self.step % every == 0
            and self.step not in self.durable_steps
        ):
            start = time.perf_counter()
            self._call(
                actors,
                "durable_write",
                lambda rank: (self.config.snapshot_dir, self.step),
                timeout_s=self.policy.hang_timeout_s,
                what="start durable snapshots",
            )
            self._timed("durable_write", start)
            self._durable_done.setdefault(self.step, set())

    def _redundancy(
        self, alive: dict[int, int], assessed: dict[int, dict[str, int]] | None = None
    ) -> Redundancy:
        own = {r: self.holdings.get(r, {}).get(r, []) for r in alive}
        held = {
            h: {w: steps for w, steps in self.holdings.get(h, {}).items() if w != h} for h in alive
        }
        return Redundancy(
            alive=alive,
            checkpoint_steps=tuple(self.checkpoint_steps),
            peer_own=own,
            peer_held=held,
            durable_steps=tuple(self.durable_steps),
            mirror_holder=self._mirror_holders(),
            mirror_stale={r: a["rows_stale"] > 0 for r, a in (assessed or {}).items()},
            pls=self._pls(alive, assessed or {})[1],
        )

    def _pls(
        self, alive: dict[int, int], assessed: dict[int, dict[str, int]]
    ) -> tuple[float, float]:
        """Embedding tables: ``(samples whose updates this failure loses, the job's PLS if
        it is accepted)``. See [Note: portion of lost samples]."""
        if self.spec.tables is None or not assessed:
            return 0.0, 0.0
        features = self.spec.tables.config.num_tables
        lost = sum(a["lost_lookups"] for a in assessed.values()) / features
        samples = max(alive.values(), default=0) * self.tokens_per_step
        total = sum(s for _, s in self._accepted) + lost
        return lost, (total / samples if samples else (0.0 if total == 0 else math.inf))

    def _assess_mirrors(self, lost: set[int], alive: dict[int, int]) -> dict[int, dict[str, int]]:
        """Embedding tables: ask each lost shard's live mirror holder what a restore gives.

        A holder that dies before answering joins ``lost`` (and leaves ``alive``), and its
        own shard's holder is asked in turn."""
        if self.spec.tables is None:
            return {}
        step = max(alive.values(), default=0)
        answers: dict[int, dict[str, int]] = {}
        while True:
            holders = {
                r: self.ring[r]
                for r in lost
                if r not in answers and alive.get(self.ring.get(r, -1)) == step
            }
            refs = {r: self.members[h].actor.assess_mirror.remote(r) for r, h in holders.items()}
            got, errors = self._gather(refs, 60.0)
            answers.update(got)
            if not errors:
                return answers
            for ward in errors:  # the holder died meanwhile: lost too, and so is the mirror
                with contextlib.suppress(Exception):
                    ray.kill(self.members[holders[ward]].actor, no_restart=True)
                lost.add(holders[ward])
                alive.pop(holders[ward], None)
                self.holdings.pop(holders[ward], None)

    def _mirror_holders(self) -> dict[int, int]:
        """Rank -> the rank mirroring its shard (ZeRO-1: the next replica of its stage;
        embedding tables: its buddy on the ring)."""
        if self.spec.tables is not None:
            return dict(self.ring)
        if not self.spec.shard_optimizer:
            return {}
        t = self.topology
        return {
            t.rank(s, r): t.rank(s, (r + 1) % t.replicas)
            for s in range(t.stages)
            for r in range(t.replicas)
        }

    # -- recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the lost workers and resume. See docs/DESIGN.md, Recovery hierarchy."""
        failure = self._failure
        assert failure is not None
        if (
            self.policy.max_recoveries is not None
            and len(self.events) >= self.policy.max_recoveries
        ):
            raise RecoveryError(
                f"{self._failure_text(failure)}\nmax_recoveries={self.policy.max_recoveries} reached"
            )
        lost = set(failure.lost)
        for rank in lost:
            with contextlib.suppress(Exception):
                ray.kill(self.members[rank].actor, no_restart=True)
        # Survivors abandon the step and leave the generation; anyone dying now is lost too.
        survivors = {rank: m for rank, m in self.members.items() if rank not in lost}
        reports, errors = self._gather(
            {rank: m.actor.prepare_recovery.remote() for rank, m in survivors.items()}, 60.0
        )
        lost |= set(errors)
        self._note_redundancy({r: rep for r, rep in reports.items() if r not in lost})
        self._commit_landed_durable()
        for rank in lost:
            self.holdings.pop(rank, None)
        alive = {rank: rep.step for rank, rep in reports.items() if rank not in lost}
        assessed = {} if failure.numerical else self._assess_mirrors(lost, alive)
        try:
            recovery = plan(
                self.topology,
                lost,
                self._redundancy(alive, assessed),
                self.policy,
                rollback_all=failure.numerical,
            )
        except RedundancyExhausted as exc:
            raise RedundancyExhausted(f"{self._failure_text(failure)}\n{exc}") from None
        log.info("%s", recovery.describe(self.topology))

        t0 = time.perf_counter()
        # New processes only for the lost workers; survivors restore in place (a rollback)
        # -- except in the restart baseline, where everyone goes and comes back cold.
        rebuild = sorted(lost)
        if recovery.strategy == Strategy.RESTART:
            rebuild = list(range(self.topology.world_size))
            for rank in alive:
                with contextlib.suppress(Exception):
                    ray.kill(self.members[rank].actor, no_restart=True)
        warm = self._replace(rebuild, cold=recovery.strategy == Strategy.RESTART)
        t_replace = time.perf_counter() - t0

        t0 = time.perf_counter()
        ring_before = dict(self.ring)
        self.form_generation()
        t_reform = time.perf_counter() - t0

        t0 = time.perf_counter()
        while True:
            try:
                moved = self._execute(recovery)
                break
            except SnapshotCorrupted as exc:  # never load it; fall back to an older snapshot
                log.warning(
                    "durable snapshot of step %d is corrupted: %s", recovery.resume_step, exc
                )
                self.durable_steps.remove(recovery.resume_step)
                recovery = plan(
                    self.topology,
                    lost,
                    self._redundancy(alive, assessed),
                    self.policy,
                    rollback_all=failure.numerical,
                )
        moved += self._seed_mirrors(recovery, ring_before)
        embedding = self._note_partial(recovery, alive, assessed)
        t_transfer = time.perf_counter() - t0

        event = RecoveryEvent(
            step=failure.step,
            generation=self.generation,
            cause=failure.cause,
            lost=[
                (self.topology.worker(r).stage, self.topology.worker(r).replica)
                for r in sorted(lost)
            ],
            strategy=recovery.strategy,
            actions=[
                {
                    "worker": (
                        self.topology.worker(a.rank).stage,
                        self.topology.worker(a.rank).replica,
                    ),
                    "strategy": a.strategy,
                    "sources": [
                        (self.topology.worker(s).stage, self.topology.worker(s).replica)
                        for s in a.sources
                    ],
                    "warm": a.rank in warm,
                }
                for a in recovery.actions
            ],
            bytes_moved=moved,
            lost_steps=failure.step - recovery.resume_step,
            time=failure.struck_at - self.started_wall,
            tier=recovery.tier,
            breakdown={
                "detect": max(0.0, failure.detected_at - failure.struck_at),
                "replace": t_replace,
                "reform": t_reform,
                "transfer": t_transfer,
            },
            detail=self._failure_text(failure) + "\n" + recovery.describe(self.topology),
            embedding=embedding,
        )
        self._pending_event = (event, time.time())
        self._failure = None
        self.step = recovery.resume_step
        self.phase = Phase.RUNNING

    def _note_partial(
        self, recovery: RecoveryPlan, alive: dict[int, int], assessed: dict[int, dict[str, int]]
    ) -> dict[str, float] | None:
        """Embedding tables: account the restore's lost samples (PLS); None for other jobs."""
        if self.spec.tables is None:
            return None
        if recovery.strategy in (Strategy.ROLLBACK, Strategy.RESTART):
            # The rolled-back steps, and the partial restores in them, are gone.
            self._accepted = [(c, s) for c, s in self._accepted if c < recovery.resume_step]
            return None
        restored = {a.rank for a in recovery.actions}
        used = {r: a for r, a in assessed.items() if r in restored}
        lost, pls = self._pls(alive, used)
        self._accepted.append((recovery.resume_step, lost))
        samples = max(alive.values(), default=0) * self.tokens_per_step
        return {
            "rows_exact": sum(a["rows_exact"] for a in used.values()),
            "rows_stale": sum(a["rows_stale"] for a in used.values()),
            "lost_samples": lost,
            "pls_event": lost / samples if samples else 0.0,
            "pls_job": pls,
        }

    def mirror_costs(self) -> dict[str, float]:
        """Embedding tables: mirror memory and update traffic per worker (averages)."""
        if self.spec.tables is None or not self.members:
            return {}
        costs = self._call(
            {rank: m.actor for rank, m in self.members.items()},
            "mirror_costs",
            timeout_s=60.0,
            what="collect mirror costs",
        )
        keys = next(iter(costs.values())).keys()
        return {k: sum(c[k] for c in costs.values()) / len(costs) for k in keys}

    def _seed_mirrors(
        self, recovery: RecoveryPlan | None = None, ring_before: dict[int, int] | None = None
    ) -> int:
        """Sharded state (ZeRO-1, embedding tables): at the start and after a recovery,
        seed the holders' mirrors with full copies. Returns bytes moved.

        After a rollback (or the start) every mirror is re-seeded: the copies are from
        another timeline. After a recovery from mirrors (``shard_mirror``,
        ``embedding_partial``) on an unchanged ring only the replacements need one: every
        other mirror still matches its owner (a holder that restored a shard from its
        mirror holds exactly what it sent), so each replacement's ward sends it its shard.
        The ZeRO-1 ring is fixed; an embedding ring follows the nodes and may change.
        """
        if not (self.spec.shard_optimizer or self.spec.tables is not None):
            return 0
        actors = {rank: m.actor for rank, m in self.members.items()}
        from_mirrors = (Strategy.SHARD_MIRROR, Strategy.EMBEDDING_PARTIAL)
        targeted = (
            recovery is not None
            and bool(recovery.actions)
            and all(a.strategy in from_mirrors for a in recovery.actions)
            and (self.spec.tables is None or ring_before == self.ring)
        )
        flags: dict[int, tuple[bool, bool]] = {}
        if targeted:
            assert recovery is not None
            holders = self._mirror_holders()
            wards = {holder: ward for ward, holder in holders.items()}
            rebuilt = {a.rank for a in recovery.actions}
            for rank in rebuilt:
                assert wards[rank] not in rebuilt, "planner invariant: the ward is alive"
                flags[wards[rank]] = (True, False)
                flags[rank] = (False, True)
            actors = {rank: actors[rank] for rank in flags}
        sent = self._call(
            actors,
            "seed_mirror",
            (lambda rank: flags[rank]) if targeted else None,
            timeout_s=self.config.start_timeout_s,
            what="seed the shard mirrors",
        )
        return sum(int(v) for v in sent.values())

    def _replace(self, ranks: Sequence[int], *, cold: bool) -> set[int]:
        """Start (or take hot spares for) ``ranks`` and build their stages.

        Returns the ranks that got a warm spare.
        """
        alive_now = [n for n in alive_nodes() if n not in self.lost_nodes] or alive_nodes()
        actors: dict[int, tuple[Any, str]] = {}
        warm: set[int] = set()
        for rank in ranks:
            node = replacement_node(self.topology, rank, self.assignment, alive_now)
            spare = None if cold else self._take_spare(node)
            if spare is not None:
                warm.add(rank)
            actors[rank] = spare if spare is not None else (self._new_actor(node), node)
            self.assignment[rank] = actors[rank][1]
        infos, errors = self._gather(
            {rank: a.info.remote() for rank, (a, _) in actors.items()}, self.config.start_timeout_s
        )
        if errors:
            raise RecoveryError(_describe_errors("start replacement workers", errors))
        for rank, (actor, _) in actors.items():
            self.members[rank] = Member(rank, actor, infos[rank])
        self._call(
            {rank: a for rank, (a, _) in actors.items()},
            "setup",
            self._setup_args,
            timeout_s=self.config.start_timeout_s,
            what="build replacement stages",
        )
        if not cold:
            self._start_spares(self.policy.hot_spares - len(self._spares))
        return warm

    def _take_spare(self, node: str) -> tuple[Any, str] | None:
        for i, (_actor, spare_node) in enumerate(self._spares):
            if spare_node == node:
                return self._spares.pop(i)
        return self._spares.pop(0) if self._spares else None

    def _execute(self, recovery: RecoveryPlan) -> int:
        """Carry out the plan's state movements. Returns the bytes moved.

        Raises:
            SnapshotCorrupted: if a durable snapshot chosen by the plan fails its checksums
                (nothing was loaded from it).
        """
        if recovery.strategy == Strategy.ROLLBACK:
            return self._rollback(recovery)
        if recovery.strategy == Strategy.RESTART:
            if recovery.resume_step > 0:
                self._call(
                    {rank: m.actor for rank, m in self.members.items()},
                    "load_checkpoint",
                    lambda rank: (self._checkpoint_dir, recovery.resume_step),
                    timeout_s=self.config.start_timeout_s,
                    what=f"load the checkpoint of step {recovery.resume_step}",
                )
            return 0
        refs: dict[tuple[int, str], Any] = {}
        by_source: dict[int, list[int]] = {}
        for action in recovery.actions:
            if action.strategy == Strategy.REPLICA_COPY:
                by_source.setdefault(action.sources[0], []).append(action.rank)
        for src, dsts in by_source.items():
            refs[(src, "send")] = self.members[src].actor.send_state.remote(dsts)
            for dst in dsts:
                refs[(dst, "copy")] = self.members[dst].actor.recv_state.remote(src)
        for action in recovery.actions:
            if action.strategy in (Strategy.SHARD_MIRROR, Strategy.EMBEDDING_PARTIAL):
                (holder,) = action.sources
                refs[(holder, f"send{action.rank}")] = self.members[
                    holder
                ].actor.send_mirror.remote(action.rank)
                refs[(action.rank, "copy")] = self.members[action.rank].actor.recv_shard.remote(
                    holder
                )
        for action in recovery.actions:
            if action.strategy in (Strategy.NEIGHBOR_AVERAGE, Strategy.EDGE_COPY):
                refs.update(self._start_rebuild(action, recovery.resume_step))
        keys = list(refs)
        results, errors = self._gather(
            {i: refs[k] for i, k in enumerate(keys)}, self.config.start_timeout_s
        )
        if errors:
            raise RecoveryError(_describe_errors("transfer state", errors))
        got = {k: results[i] for i, k in enumerate(keys)}
        steps = {
            got[(a.rank, "copy")][0]
            for a in recovery.actions
            if a.strategy in (Strategy.REPLICA_COPY, Strategy.SHARD_MIRROR, Strategy.EMBEDDING_PARTIAL)
        }
        assert steps <= {recovery.resume_step}, (steps, recovery.resume_step)
        for action in recovery.actions:  # a rebuilt stage has no gradient history yet
            if action.strategy in (Strategy.NEIGHBOR_AVERAGE, Strategy.EDGE_COPY):
                self.grad_norms[self.topology.worker(action.rank).stage] = None
        return sum(
            int(v) for k, v in got.items() if k[1].startswith("send") or k[1].startswith("named")
        )

    def _start_rebuild(self, action: Action, step: int) -> dict[tuple[int, str], Any]:
        """Start a CheckFree(+) rebuild of ``action.rank`` from its neighbours' live workers."""
        stage = self.topology.worker(action.rank).stage
        if action.strategy == Strategy.NEIGHBOR_AVERAGE:
            roles = {"prev": action.sources[0], "next": action.sources[1]}
        else:  # edge_copy: stage 0 copies stage 1 (its next), stage S-1 copies S-2 (its prev)
            roles = {"next" if stage == 0 else "prev": action.sources[0]}
        config = self.policy.checkfree
        moments = not config.reset_optimizer or self.spec.shared_params is not None
        refs: dict[tuple[int, str], Any] = {}
        for role, src in roles.items():
            refs[(src, f"named{action.rank}{role}")] = self.members[
                src
            ].actor.send_named_state.remote(action.rank, moments)
        norms = (
            self.grad_norms[stage - 1] if stage > 0 else None,
            self.grad_norms[stage + 1] if stage + 1 < self.topology.stages else None,
        )
        refs[(action.rank, "rebuild")] = self.members[action.rank].actor.rebuild.remote(
            action.strategy, roles, norms, config, step
        )
        return refs

    def _rollback(self, recovery: RecoveryPlan) -> int:
        """Every worker restores the plan's snapshot: its own copy, a holder's, or the durable tier."""
        step = recovery.resume_step
        moved = 0
        if recovery.tier == Tier.DURABLE:
            self._call(
                {rank: m.actor for rank, m in self.members.items()},
                "durable_load",
                lambda rank: (self.config.snapshot_dir, step),
                timeout_s=self.config.start_timeout_s,
                what=f"load the durable snapshot of step {step}",
            )
        else:
            refs: dict[tuple[int, str], Any] = {}
            for action in recovery.actions:
                target = self.members[action.rank].actor
                if not action.sources:
                    refs[(action.rank, "own")] = target.restore_own.remote(step)
                    continue
                (holder,) = action.sources
                refs[(holder, f"send{action.rank}")] = self.members[
                    holder
                ].actor.send_snapshot.remote(step, action.rank, action.rank)
                refs[(action.rank, "recv")] = target.recv_snapshot.remote(step, holder)
            keys = list(refs)
            results, errors = self._gather(
                {i: refs[k] for i, k in enumerate(keys)}, self.config.start_timeout_s
            )
            if errors:
                raise RecoveryError(_describe_errors(f"roll back to step {step}", errors))
            moved = sum(int(results[i]) for i, k in enumerate(keys) if k[1].startswith("send"))
        if self.durable is not None:
            self.durable.discard_after(step)
        self.durable_steps = [s for s in self.durable_steps if s <= step]
        self._durable_done = {}
        for held in self.holdings.values():
            for rank in list(held):
                held[rank] = [s for s in held[rank] if s <= step]
        return moved

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

    def _failure_text(self, failure: _Failure) -> str:
        lines = [f"step {failure.step} failed in generation {self.generation} ({failure.cause}):"]
        for rank, error in sorted(failure.errors.items()):
            lines.append(
                f"  worker {self.topology.worker(rank)} (rank {rank}): {error.splitlines()[0][:300] if error else ''}"
            )
        return "\n".join(lines)

    def _timed(self, name: str, start: float) -> None:
        self.timings.setdefault(name, []).append(time.perf_counter() - start)

    def _save_checkpoint(self) -> None:
        start = time.perf_counter()
        self._call(
            {rank: m.actor for rank, m in self.members.items()},
            "save_checkpoint",
            lambda rank: (self._checkpoint_dir, self.step),
            timeout_s=self.config.start_timeout_s,
            what=f"checkpoint step {self.step}",
        )
        self.checkpoint_steps.append(self.step)
        self._timed("checkpoint_write", start)

    # -- metrics -------------------------------------------------------------------------

    def _record(self, step: int, reports: dict[int, StepReport], elapsed: float) -> StepRecord:
        loss_sum = sum(r.stats.loss_sum for r in reports.values())
        count = sum(r.stats.losses for r in reports.values())
        loss = loss_sum / count if count else math.nan
        norms = [
            reports[self.topology.rank(s, 0)].stats.clipped_grad_norm
            for s in range(self.topology.stages)
        ]
        busy = sum(r.stats.compute_s for r in reports.values())
        span = sum(r.stats.schedule_s for r in reports.values())
        return StepRecord(
            step=step,
            loss=loss,
            time=time.perf_counter() - self.started_at,
            step_s=elapsed,
            tokens_per_s=self.tokens_per_step / elapsed if elapsed > 0 else 0.0,
            generation=self.generation,
            grad_norms=norms,
            bubble=1.0 - busy / span if span > 0 else 0.0,
        )

    def evaluate(self) -> float | None:
        """Mean held-out loss over ``eval_batches`` batches (forward only, every pipeline).

        A failure during evaluation is handled like one during a step (the phase becomes
        RECOVERING) and the evaluation is skipped: returns None.
        """
        if self.spec.val_batches is None:
            return math.nan
        total, count = 0.0, 0
        for index in range(self.config.eval_batches):
            struck_at = time.time()
            refs = {rank: m.actor.evaluate.remote(index) for rank, m in self.members.items()}
            reports, errors, hung = self._await_step(refs)
            failed = {rank: r.error for rank, r in reports.items() if not r.ok}
            if errors or failed:
                self._fail(self.step, set(errors), failed, errors, hung, struck_at, {})
                return None
            total += sum(r.stats.loss_sum for r in reports.values())
            count += sum(r.stats.losses for r in reports.values())
        return total / count if count else math.nan

    # -- results and shutdown ------------------------------------------------------------

    def states(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Every worker's final state, keyed by (stage, replica)."""
        actors = {rank: m.actor for rank, m in self.members.items()}
        if self.spec.shard_optimizer:  # the parameters a replica does not own are a step behind
            self._call(
                actors, "sync_params", timeout_s=self.config.start_timeout_s, what="sync parameters"
            )
        states = self._call(
            actors, "state", timeout_s=self.config.start_timeout_s, what="collect states"
        )
        return {
            (self.topology.worker(rank).stage, self.topology.worker(rank).replica): state
            for rank, state in states.items()
        }

    def shutdown(self) -> None:
        """Park healthy workers in the pool (after a clean finish) or kill them; drop the store."""
        members, self.members = self.members, {}
        spares, self._spares = self._spares, []
        keep: dict[int, Member] = {}
        if members:  # workers that can still reset themselves are reused, whatever happened
            refs = {rank: m.actor.reset.remote() for rank, m in members.items()}
            with contextlib.suppress(Exception):
                done, _ = self._gather(refs, 30.0 if self.phase is Phase.FINISHED else 5.0)
                keep = {rank: members[rank] for rank in done}
        for rank, member in members.items():
            if rank in keep:
                POOL.park(member.actor, member.info.node_id, self._pool_key)
            else:
                with contextlib.suppress(Exception):
                    ray.kill(member.actor, no_restart=True)
        for actor, node in spares:
            POOL.park(actor, node, self._pool_key)
        self._store = None

    # -- Ray plumbing --------------------------------------------------------------------

    def _gather(
        self, refs: dict[int, Any], timeout_s: float
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """Results per rank, and the ranks whose actor died or did not answer in time.

        Raises:
            Exception: the original error of a worker whose user code raised.
        """
        pending = list(refs.values())
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        for rank, ref in refs.items():
            try:
                results[rank] = ray.get(ref, timeout=0)
            except (RayActorError, GetTimeoutError) as exc:
                errors[rank] = exc
            except RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
        return results, errors

    def _call(
        self,
        actors: dict[int, Any],
        method: str,
        args: Callable[[int], Sequence[Any]] | None = None,
        *,
        timeout_s: float,
        what: str,
    ) -> dict[int, Any]:
        """Call ``method`` on every actor and return the results; any failure is fatal here.

        Raises:
            RecoveryError: naming the workers that died or timed out while doing ``what``.
        """
        refs = {
            rank: getattr(actor, method).remote(*(args(rank) if args else ()))
            for rank, actor in actors.items()
        }
        results, errors = self._gather(refs, timeout_s)
        if errors:
            raise RecoveryError(_describe_errors(what, errors))
        return results


def _non_finite(reports: dict[int, StepReport]) -> dict[int, str]:
    """Workers whose loss or gradient norm is NaN or infinite, with what was seen."""
    bad = {}
    for rank, r in reports.items():
        if (r.stats.losses and not math.isfinite(r.stats.loss_sum)) or not math.isfinite(
            r.stats.grad_norm
        ):
            bad[rank] = f"non-finite loss {r.stats.loss_sum} or gradient norm {r.stats.grad_norm}"
    return bad


def _succeeded(ref: Any) -> bool:
    """Whether a finished step call returned a successful report."""
    try:
        return bool(ray.get(ref, timeout=0).ok)
    except Exception:
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _describe_errors(what: str, errors: dict[int, BaseException]) -> str:
    detail = "; ".join(f"rank {r}: {_first_line(e)}" for r, e in sorted(errors.items()))
    return f"could not {what}: {detail}"
