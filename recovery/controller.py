"""The controller: owns membership, hosts the store, drives steps, detects failures.

It runs in the driver process (the one that calls `Trainer.fit`), never on a worker, so
losing any worker never loses the store or the job's bookkeeping. It is an explicit state
machine (`Phase`); `advance` performs exactly one transition, which is what tests drive.

    STARTING --start()--> RUNNING --step ok--> RUNNING --all steps--> FINISHED
                             |  ^
                     failure |  | recovered
                             v  |
                          RECOVERING --no way out--> FAILED
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from parallelism.comm import Rendezvous, host_store
from parallelism.topology import Topology
from recovery.errors import RecoveryError
from recovery.placement import place
from recovery.ray_env import alive_nodes, connect, driver_host
from recovery.spec import TrainSpec
from recovery.worker import StageWorker, StepReport, WorkerInfo

log = logging.getLogger("checkfree")


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"


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
    step_timeout_s: float = 300.0
    join_timeout_s: float = 60.0
    worker_options: dict[str, Any] = field(default_factory=dict)


class Controller:
    """Drives one training job on Ray. See the module docstring for the state machine."""

    def __init__(
        self,
        spec: TrainSpec,
        topology: Topology,
        config: ControllerConfig,
        *,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.spec = spec
        self.topology = topology
        self.config = config
        self.on_step = on_step or (lambda record: None)
        self.phase = Phase.STARTING
        self.generation = -1
        self.step = 0
        self.target_steps = 0
        self.members: dict[int, Member] = {}
        self.assignment: dict[int, str] = {}
        self.records: list[StepRecord] = []
        self.tokens_per_step = 0
        self.started_at = time.perf_counter()
        self.started_ray = False
        self._store: Any = None
        self.host = "127.0.0.1"
        self.error: BaseException | None = None

    # -- startup -------------------------------------------------------------------------

    def start(self) -> None:
        """Connect to Ray, host the store, start and set up every worker, form generation 0."""
        assert self.phase is Phase.STARTING
        self.tokens_per_step = self.spec.check(self.topology)
        self.started_ray = connect()
        self.host = "127.0.0.1" if self.started_ray else driver_host()
        self._store = host_store(self.host)
        self.assignment = place(self.topology, alive_nodes())
        actors = {
            rank: self._new_actor(self.assignment[rank]) for rank in range(self.topology.world_size)
        }
        infos = self._call(
            actors, "info", timeout_s=self.config.start_timeout_s, what="start workers"
        )
        self.members = {rank: Member(rank, actors[rank], infos[rank]) for rank in actors}
        self._call(
            actors,
            "setup",
            lambda rank: (self.spec, self.topology, rank, self.config.backend),
            timeout_s=self.config.start_timeout_s,
            what="build stages",
        )
        self.form_generation()
        self.started_at = time.perf_counter()
        self.phase = Phase.RUNNING

    def _new_actor(self, node_id: str) -> Any:
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0}
        options.update(self.config.worker_options)
        if node_id:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
        return ray.remote(StageWorker).options(**options).remote(self.config.threads_per_worker)

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
        actors = {rank: m.actor for rank, m in self.members.items()}
        self._call(
            actors,
            "join",
            lambda rank: (self.generation, rendezvous, self.members[rank].info.host),
            timeout_s=self.config.join_timeout_s + 10,
            what=f"form generation {self.generation}",
        )
        return time.perf_counter() - start

    # -- the state machine ---------------------------------------------------------------

    def run(self, steps: int, progress: Callable[[StepRecord], None] | None = None) -> None:
        """Advance until ``steps`` steps are committed (or the job fails)."""
        self.target_steps = steps
        if self.phase is Phase.STARTING:
            self.start()
        while self.phase not in (Phase.FINISHED, Phase.FAILED):
            self.advance()
        if self.phase is Phase.FAILED:
            assert self.error is not None
            raise self.error

    def advance(self) -> Phase:
        """Perform one transition of the state machine and return the new phase."""
        if self.phase is Phase.RUNNING:
            if self.step >= self.target_steps:
                self.phase = Phase.FINISHED
            else:
                self._train_step()
        elif self.phase is Phase.RECOVERING:
            self.error = RecoveryError(self._failure_text)
            self.phase = Phase.FAILED
        return self.phase

    def _train_step(self) -> None:
        step = self.step
        start = time.perf_counter()
        actors = {rank: m.actor for rank, m in self.members.items()}
        reports, failures = self._gather(
            {rank: a.run_step.remote(step) for rank, a in actors.items()},
            self.config.step_timeout_s,
        )
        failed = {rank: r.error for rank, r in reports.items() if not r.ok}
        failed.update({rank: str(e) for rank, e in failures.items()})
        if failed:
            self._on_failure(step, failed)
            return
        self._call(
            actors,
            "commit",
            lambda rank: (step,),
            timeout_s=self.config.step_timeout_s,
            what=f"commit step {step}",
        )
        elapsed = time.perf_counter() - start
        record = self._record(step, reports, elapsed)
        self.step = step + 1
        if self.config.eval_every and (
            self.step % self.config.eval_every == 0 or self.step == self.target_steps
        ):
            record.val_loss = self.evaluate()
        self.records.append(record)
        self.on_step(record)

    def _on_failure(self, step: int, failed: dict[int, str]) -> None:
        lines = [f"step {step} failed in generation {self.generation}:"]
        for rank, error in sorted(failed.items()):
            lines.append(
                f"  worker {self.topology.worker(rank)} (rank {rank}): {error.splitlines()[0][:300]}"
            )
        self._failure_text = "\n".join(lines)
        log.error(self._failure_text)
        self.phase = Phase.RECOVERING

    def _record(self, step: int, reports: dict[int, StepReport], elapsed: float) -> StepRecord:
        loss_sum = sum(r.stats.loss_sum for r in reports.values())
        count = sum(r.stats.losses for r in reports.values())
        loss = loss_sum / count if count else math.nan
        norms = [
            reports[self.topology.rank(s, 0)].stats.clipped_grad_norm
            for s in range(self.topology.stages)
        ]
        return StepRecord(
            step=step,
            loss=loss,
            time=time.perf_counter() - self.started_at,
            step_s=elapsed,
            tokens_per_s=self.tokens_per_step / elapsed if elapsed > 0 else 0.0,
            generation=self.generation,
            grad_norms=norms,
        )

    def evaluate(self) -> float:
        """Mean held-out loss over ``eval_batches`` batches (forward only, every pipeline)."""
        if self.spec.val_batches is None:
            return math.nan
        actors = {rank: m.actor for rank, m in self.members.items()}
        total, count = 0.0, 0
        for index in range(self.config.eval_batches):
            reports = self._call(
                actors,
                "evaluate",
                lambda rank, index=index: (index,),  # type: ignore[misc]
                timeout_s=self.config.step_timeout_s,
                what="evaluate",
            )
            total += sum(r.stats.loss_sum for r in reports.values())
            count += sum(r.stats.losses for r in reports.values())
        return total / count if count else math.nan

    # -- results and shutdown ------------------------------------------------------------

    def states(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Every worker's final state, keyed by (stage, replica)."""
        actors = {rank: m.actor for rank, m in self.members.items()}
        states = self._call(
            actors, "state", timeout_s=self.config.step_timeout_s, what="collect states"
        )
        return {
            (self.topology.worker(rank).stage, self.topology.worker(rank).replica): state
            for rank, state in states.items()
        }

    def shutdown(self) -> None:
        """Kill every worker and stop the store (and the local Ray, if we started it)."""
        for member in self.members.values():
            with contextlib.suppress(Exception):
                ray.kill(member.actor, no_restart=True)
        self.members = {}
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
        ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        for rank, ref in refs.items():
            try:
                results[rank] = ray.get(ref, timeout=0)
            except RayActorError as exc:
                errors[rank] = exc
            except GetTimeoutError as exc:
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
            detail = "; ".join(
                f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                for r, e in sorted(errors.items())
            )
            raise RecoveryError(f"could not {what}: {detail}")
        return results
