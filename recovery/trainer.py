"""The public entry point: `Trainer(spec, topology=...).fit(steps)` -> `FitResult`."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from parallelism.checks import check_bool, check_choice, check_int
from parallelism.comm import default_backend
from parallelism.devices import BACKENDS, Backend, Device, check_device
from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.callbacks import (
    Callback,
    CallbackList,
    TensorBoardLogger,
    require_tensorboard,
    tensorboard_installed,
)
from recovery.events import RecoveryEvent
from recovery.faults import FailureSchedule
from recovery.groups.resources import worker_ask
from recovery.names import FailureCause, Strategy, Tier
from recovery.policy import RecoveryPolicy
from recovery.rundir import FolderLock, RunDir, plot_loss
from recovery.runtime import Controller, ControllerConfig, FitResult, StepRecord
from recovery.snapshots.reshard import RESUME_MODES, Resume
from recovery.worker import WorkerInfo

__all__ = ["FitResult", "Trainer", "final_trajectory"]


def _snapshot_dir(policy: RecoveryPolicy, run_dir: RunDir | None) -> str | None:
    if policy.snapshots.dir is not None:
        return str(policy.snapshots.dir)
    return str(run_dir.file("snapshots")) if run_dir is not None else None


def _resharded(old: Topology | None, new: Topology) -> str:
    if old is None:
        return ""
    return (
        f", resharded from {old.stages} stages x {old.replicas} replicas to "
        f"{new.stages} x {new.replicas}"
    )


def final_trajectory(records: list[StepRecord]) -> list[float]:
    """Loss per step of the final trajectory: a redone step's last run wins."""
    by_step: dict[int, float] = {}
    for record in records:
        by_step[record.step] = record.loss
    return [by_step[s] for s in sorted(by_step)]


class Trainer:
    """Trains ``spec`` on Ray workers laid out as ``topology``.

    Args:
        spec: the model, loss, optimizer and data.
        topology: ``Topology(stages, replicas)``.
        policy: what to do when workers die (default: the recovery hierarchy).
        failures: faults to inject (tests, experiments, demos).
        backend: ``"gloo"`` or ``"nccl"`` (`Backend`); default: ``nccl`` if CUDA is available.
        device: what each worker computes on (`Device`): ``"cpu"``, ``"cuda"`` (the GPU Ray
            gives it),
            or None (default): the backend's own -- CPU under Gloo, the worker's GPU under
            NCCL. ``backend="gloo", device="cuda"`` computes on CUDA and communicates over
            Gloo, staged through pinned host memory: several workers may then share one
            GPU (each asks Ray for a share of one, see recovery/groups/resources.py). See
            parallelism/devices.py.
        run_dir: a folder for metrics, events, summary, plot and TensorBoard files
            (created); None: none. See docs/metrics.md.
        progress: show a progress bar.
        eval_every: evaluate held-out loss every this many steps (0: never).
        eval_batches: held-out batches per evaluation.
        threads_per_worker: torch intra-op threads per worker.
        collect_states: fetch every worker's final state into the result.
        worker_resources: what each worker (and hot spare) asks Ray for, e.g.
            ``{"CPU": 1}`` or ``{"GPU": 1, "CPU": 4}``; other names are custom Ray
            resources. Default: no CPU (workers share a node), and one GPU under NCCL.
            With a real ask Ray sees when a node is full, and a worker that finds no room
            within ``RecoveryPolicy.timeouts.replace`` ends the job with a
            ``PlacementFailed`` naming it. Placement is unchanged: replicas of a stage
            still go to different nodes.
        callbacks: objects whose ``on_step(record)``, ``on_event(event)``,
            ``on_fit_end(result)`` and ``on_fit_error(error)`` (any of them: see
            `recovery.Callback`) the driver calls, in this order, as the job trains. One
            that raises is logged, naming it, and training goes on.
        resume: what to do with durable snapshots in the snapshot folder (`Resume`):
            ``"auto"`` (default) resumes from the newest intact one if the same job on the
            same topology wrote it (another topology is refused, naming both);
            ``"reshard"`` also resumes on another topology, the state by parameter name
            and the global batch kept (see docs/resume.md); ``"never"`` starts afresh, and
            a folder that holds snapshots is refused before any worker starts.
        tensorboard: TensorBoard event files in ``<run_dir>/tensorboard`` (a
            `TensorBoardLogger`, called before ``callbacks``). None (default): when there
            is a ``run_dir`` and the tensorboard package is installed (``pip install
            'checkfree[tensorboard]'``), unless ``callbacks`` holds a `TensorBoardLogger`
            already; True: always (an error without either); False: never.

    Raises:
        ValueError: for a bad argument (a choice not among the allowed values, naming them;
            a flag that is not a bool; a callback with none of the hooks;
            ``tensorboard=True`` without a ``run_dir``); raised here, before anything
            starts.
        ImportError: for ``tensorboard=True`` without the tensorboard package.
    """

    def __init__(
        self,
        spec: TrainSpec,
        *,
        topology: Topology,
        policy: RecoveryPolicy | None = None,
        failures: FailureSchedule | None = None,
        backend: Backend | None = None,
        device: Device | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        progress: bool = False,
        eval_every: int = 0,
        eval_batches: int = 1,
        threads_per_worker: int = 1,
        collect_states: bool = True,
        worker_resources: Mapping[str, float] | None = None,
        callbacks: Sequence[Callback] = (),
        tensorboard: bool | None = None,
        resume: Resume = "auto",
    ) -> None:
        if not isinstance(spec, TrainSpec):
            raise ValueError(f"spec must be a TrainSpec, got {type(spec).__name__}")
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a Topology, got {type(topology).__name__}")
        chosen: Backend = check_choice("backend", backend or default_backend(), BACKENDS)
        check_device(chosen, device)
        if spec.tables is not None and device not in (None, "cpu"):
            raise ValueError(
                f"sharded embedding tables (dlrm_spec) train on the CPU, not on "
                f"device {device!r}: leave device unset or 'cpu'"
            )
        check_int("eval_every", eval_every, minimum=0)
        check_int("eval_batches", eval_batches, minimum=0)
        check_int("threads_per_worker", threads_per_worker, minimum=1)
        check_bool("progress", progress)
        self.resume: Resume = check_choice("resume", resume, RESUME_MODES)
        check_bool("collect_states", collect_states)
        self.callbacks = CallbackList(callbacks)
        if tensorboard is not None and not isinstance(tensorboard, bool):
            raise ValueError(f"tensorboard must be None, True or False, got {tensorboard!r}")
        if tensorboard and run_dir is None:
            raise ValueError("tensorboard=True writes into the run folder: set run_dir too")
        if tensorboard:
            require_tensorboard()
        self.tensorboard = tensorboard
        resources = worker_ask(worker_resources, chosen, device)
        policy = RecoveryPolicy() if policy is None else policy
        if not isinstance(policy, RecoveryPolicy):
            raise ValueError(f"policy must be a RecoveryPolicy, got {type(policy).__name__}")
        failures = FailureSchedule() if failures is None else failures
        if not isinstance(failures, FailureSchedule):
            raise ValueError(f"failures must be a FailureSchedule, got {type(failures).__name__}")
        failures.check(topology)
        if policy.hot_spares > topology.world_size:
            raise ValueError(
                f"hot_spares={policy.hot_spares} exceeds the job's {topology.world_size} workers: "
                "each spare holds a process (and, under NCCL, a GPU) idle"
            )
        if policy.swapped_routes and (spec.routes != "swapped" or spec.shared_params is None):
            raise ValueError(
                "RecoveryPolicy(approximate='checkfree+') needs a model trained for it: swapped "
                "routes and (de)embedding replicas, e.g. llama_spec(..., checkfree_plus=True)"
            )
        self.spec = spec
        self.topology = topology
        self.policy = policy
        self.failures = failures
        self.backend = chosen
        self.device = device
        self.run_dir = RunDir(run_dir) if run_dir is not None else None
        self.progress = progress
        self.collect_states = collect_states
        self._training: Controller | None = None
        """The job while `fit` trains (between the first generation and the last commit)."""
        self.config = ControllerConfig(
            backend=chosen,
            device=device,
            threads_per_worker=threads_per_worker,
            worker_resources=resources,
            eval_every=eval_every,
            eval_batches=max(1, eval_batches),
            work_dir=str(self.run_dir.file("checkpoints")) if self.run_dir else None,
            snapshot_dir=_snapshot_dir(policy, self.run_dir),
            resume=resume != "never",
            reshard=resume == "reshard",
        )
        if policy.snapshots.durable_every is not None and self.config.snapshot_dir is None:
            raise ValueError(
                "snapshots.durable_every needs a folder: set RecoveryPolicy(snapshots=SnapshotPolicy("
                "dir=...)) or run_dir"
            )

    def fit(self, steps: int) -> FitResult:
        """Train for ``steps`` committed steps and return losses, events and final states.

        The callbacks see every step and recovery as it happens, then ``on_fit_end`` with
        the result (or ``on_fit_error`` with what this raises).

        Raises:
            ValueError: for a bad spec/topology combination, before any worker starts.
            FolderInUse: if another job holds the run folder or the snapshot folder
                (`recovery.rundir.FolderLock`), before any worker starts.
            RecoveryError: if a failure could not be recovered.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        self.failures.check(self.topology, steps)
        callbacks = self._job_callbacks()
        try:
            if self.run_dir is None:
                result = self._fit(steps, callbacks)
            else:
                with FolderLock(self.run_dir.path, "run folder"):  # for the job's life
                    result = self._fit(steps, callbacks)
        except BaseException as exc:
            callbacks.on_fit_error(exc)
            raise
        callbacks.on_fit_end(result)
        return result

    def _job_callbacks(self) -> CallbackList:
        """The user's callbacks, after the run folder's TensorBoard logger if it has one."""
        user = self.callbacks.callbacks
        wanted = self.tensorboard
        if wanted is None:
            wanted = (
                self.run_dir is not None
                and tensorboard_installed()
                and not any(isinstance(c, TensorBoardLogger) for c in user)
            )
        if not wanted or self.run_dir is None:
            return self.callbacks
        return CallbackList([TensorBoardLogger(self.run_dir.file("tensorboard")), *user])

    def _fit(self, steps: int, callbacks: CallbackList) -> FitResult:
        bar = _ProgressBar(steps, enabled=self.progress)
        run_dir = self.run_dir

        def on_step(record: StepRecord) -> None:
            bar.update(record)
            if run_dir is not None:
                run_dir.append("metrics.jsonl", record.to_dict())
            callbacks.on_step(record)

        def on_event(event: RecoveryEvent) -> None:
            bar.note(f"recovered step {event.step} ({event.strategy}) in {event.seconds:.2f} s")
            if run_dir is not None:
                run_dir.append("events.jsonl", event.to_dict())
            callbacks.on_event(event)

        controller = Controller(
            self.spec,
            self.topology,
            self.config,
            policy=self.policy,
            failures=self.failures,
            on_step=on_step,
            on_event=on_event,
        )
        t0 = time.perf_counter()
        try:
            controller.start()  # validates the spec before any worker starts
            startup_s = time.perf_counter() - t0
            if run_dir is not None:
                run_dir.write_json("config.json", self._describe(steps))
            if controller.resumed_from is not None:
                self._note_resume(controller, bar)
            self._training = controller
            controller.run(steps)
            self._training = None
            wall_s = time.perf_counter() - controller.started_at
            states = controller.states() if self.collect_states else {}
            mirrors = controller.mirror_costs()
        finally:
            self._training = None
            bar.close()
            controller.shutdown()
        metrics = [r.to_dict() for r in controller.records]
        result = FitResult(
            losses=final_trajectory(controller.records),
            metrics=metrics,
            events=list(controller.events),
            wall_s=wall_s,
            startup_s=startup_s,
            run_dir=run_dir.path if run_dir else None,
            timings=dict(controller.persistence.timings),
            states=states,
            mirrors=mirrors,
            skipped_snapshots=[s.to_dict() for s in controller.persistence.skipped],
        )
        if run_dir is not None:
            run_dir.write_json("summary.json", self._summary(result))
            plot_loss(
                metrics,
                [e.to_dict() for e in result.events],
                run_dir.file("loss.png"),
                title=self._title(),
            )
        return result

    def live_workers(self) -> dict[tuple[int, int], WorkerInfo]:
        """Where each of the job's workers runs (pid, node), by (stage, replica), while `fit`
        trains -- for tools that fail workers from outside the library (scripts/chaos.py),
        called from another thread. A replacement appears once its process has started; a
        worker the controller has not yet noticed is dead is still listed. Empty before the
        first generation has formed and once the last step has committed (the final
        states are then being fetched, and a worker lost then is not recovered)."""
        controller = self._training
        if controller is None:
            return {}
        for _ in range(10):  # the controller thread may be replacing workers meanwhile
            try:
                infos = controller.infos()
            except (KeyError, RuntimeError):
                time.sleep(0.001)
                continue
            return {
                (w.stage, w.replica): info
                for rank, info in infos.items()
                for w in [self.topology.worker(rank)]
            }
        return {}

    def holders(self) -> dict[tuple[int, int], WorkerInfo]:
        """The workers of `live_workers` that hold their stage's state now: all of them
        while the job trains, less those a recovery under way is rebuilding (a replacement
        holds its state once the recovery is done) -- for tools that fail workers from
        outside, to tell whether a replica of every stage lived (scripts/chaos.py). Called
        from another thread; a worker that died unnoticed is still listed."""
        controller = self._training
        if controller is None:
            return {}
        for _ in range(10):  # the controller thread may be changing the sets meanwhile
            try:
                rebuilding = controller.rebuilding()
                break
            except RuntimeError:
                time.sleep(0.001)
        else:
            return {}
        return {
            coords: info
            for coords, info in self.live_workers().items()
            if self.topology.rank(*coords) not in rebuilding
        }

    def _note_resume(self, controller: Controller, bar: _ProgressBar) -> None:
        """After a driver death: keep the earlier run's record and log the rollback."""
        step = controller.resumed_from
        assert step is not None
        earlier = self.run_dir.read_lines("metrics.jsonl") if self.run_dir else []
        fields = {f.name for f in dataclasses.fields(StepRecord)}
        controller.records = [
            StepRecord(**{k: v for k, v in m.items() if k in fields})
            for m in earlier
            if m["step"] < step
        ]
        reached = max((m["step"] + 1 for m in earlier), default=step)
        event = RecoveryEvent(
            step=reached,
            generation=controller.generation,
            cause=FailureCause.DRIVER_RESTARTED,
            lost=[(w.stage, w.replica) for w in self.topology.workers()],
            strategy=Strategy.ROLLBACK,
            lost_steps=max(0, reached - step),
            tier=Tier.DURABLE,
            detail=f"resumed from the durable snapshot of step {step} in {self.config.snapshot_dir}"
            + _resharded(controller.persistence.resharded_from, self.topology),
        )
        controller.events.append(event)
        controller.on_event(event)
        bar.note(f"resumed from the durable snapshot of step {step}")

    def _title(self) -> str:
        return (
            f"{self.spec.name}, {self.topology.stages} stages x {self.topology.replicas} replicas"
        )

    def _describe(self, steps: int) -> dict[str, Any]:
        return {
            "spec": {
                f.name: (
                    getattr(self.spec, f.name)
                    if isinstance(getattr(self.spec, f.name), int | float | str | None)
                    else repr(getattr(self.spec, f.name))
                )
                for f in dataclasses.fields(self.spec)
            },
            "topology": {"stages": self.topology.stages, "replicas": self.topology.replicas},
            "backend": self.backend,
            "device": self.device,
            "steps": steps,
            "policy": {
                f.name: repr(getattr(self.policy, f.name)) for f in dataclasses.fields(self.policy)
            },
            "failures": str(self.failures),
        }

    def _summary(self, result: FitResult) -> dict[str, Any]:
        tail = result.losses[-10:]
        return {
            "steps": len(result.losses),
            "final_loss": tail[-1] if tail else None,
            "mean_loss_last_10": sum(tail) / len(tail) if tail else None,
            "val_losses": result.val_losses,
            "wall_s": result.wall_s,
            "startup_s": result.startup_s,
            "steps_per_s": result.steps_per_s,
            "tokens_per_s": (
                sum(m["tokens_per_s"] for m in result.metrics) / len(result.metrics)
                if result.metrics
                else None
            ),
            "recoveries": len(result.events),
            "recovery_seconds": sum(e.seconds for e in result.events),
            "lost_steps": sum(e.lost_steps for e in result.events),
            "skipped_snapshots": len(result.skipped_snapshots),
        }


class _ProgressBar:
    """A tqdm bar showing loss and steps/s (a no-op when disabled)."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def update(self, record: StepRecord) -> None:
        if self._bar is not None:
            postfix = {"loss": f"{record.loss:.3f}", "tok/s": f"{record.tokens_per_s:,.0f}"}
            if record.val_loss is not None:
                postfix["val"] = f"{record.val_loss:.3f}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
