"""Whole jobs in this process, for tests: the real `Controller` over a `ThreadWorkerGroup`.

`make` builds and starts a job whose workers are threads -- real `StageWorker`s forming
Gloo groups on a store hosted here, exactly as under Ray -- and `drive` advances it one
transition at a time to the end, so a test runs the engine, the schedules and every
controller transition in a second, without Ray. `in_threads` runs a few callables at once,
for tests below the controller (`StageComm`, a worker's collectives).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from parallelism import Topology
from parallelism.spec import TrainSpec
from recovery import FailureSchedule, RecoveryPolicy
from recovery.groups import ThreadWorkerGroup
from recovery.runtime import Controller, ControllerConfig, Phase
from recovery.runtime.layouts import layout_for

STEPS = 5
"""The steps `make` sets a job to train, unless told otherwise."""


def make(
    spec: TrainSpec,
    top: Topology,
    *faults: object,
    policy: RecoveryPolicy | None = None,
    nodes: int = 2,
    steps: int = STEPS,
    snapshot_dir: str | None = None,
    slots: int | None = None,
    eval_every: int = 0,
    device: str | None = None,
) -> tuple[Controller, ThreadWorkerGroup]:
    """A started job (generation 0 formed) of ``spec`` on ``top``, set to train ``steps``
    steps with ``faults`` injected, its workers threads spread over ``nodes`` nodes of
    ``slots`` workers each (None: any number; durable snapshots, if the policy takes them,
    in ``snapshot_dir``), evaluating every ``eval_every`` steps (0: never), computing on
    ``device`` (None: the backend's own)."""
    policy = policy or RecoveryPolicy()
    group = ThreadWorkerGroup(
        layout_for(spec, top, policy, 1).worker_cls,
        nodes=[f"node-{i}" for i in range(nodes)],
        slots=slots,
    )
    controller = Controller(
        spec,
        top,
        ControllerConfig(
            backend="gloo", snapshot_dir=snapshot_dir, eval_every=eval_every, device=device
        ),
        policy=policy,
        failures=FailureSchedule(list(faults)),  # type: ignore[arg-type]
        group=group,
    )
    controller.start()
    controller.target_steps = steps
    return controller, group


def drive(controller: Controller) -> list[Phase]:
    """Advance ``controller`` until it finishes or fails; return the phases it went through.

    The workers' final states (if it finished) are left in ``controller.final_states``,
    keyed by (stage, replica); the workers are shut down either way.
    """
    phases = []
    try:
        while controller.phase not in (Phase.FINISHED, Phase.FAILED):
            phases.append(controller.advance())
        states = controller.states() if controller.phase is Phase.FINISHED else {}
    finally:
        controller.shutdown()
    controller.final_states = states  # type: ignore[attr-defined]
    return phases


def in_threads(fns: list[Callable[[], Any]], timeout_s: float = 60.0) -> list[Any]:
    """Run ``fns`` concurrently; return their results (an exception is returned, not raised)."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # handed back to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a worker thread did not finish in time"
    return out


def ray_cluster(cpus_per_node: int, worker_nodes: int = 2) -> Iterator[tuple[Any, list[Any]]]:
    """A fixture body: `recovery.groups.ray_env.local_cluster` (a head and ``worker_nodes`` nodes of
    ``cpus_per_node`` CPUs each, on loopback, this process connected), torn down after."""
    from recovery.groups.ray_env import local_cluster

    with local_cluster(cpus_per_node, worker_nodes) as (cluster, workers):
        yield cluster, workers
