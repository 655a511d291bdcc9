"""Run a job's workers as threads of this process: the runtime's math without Ray.

Each `StageWorker` forms its own Gloo process groups on a store hosted here, exactly as
under Ray, so these tests exercise the engine, schedules and communication in a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from parallelism import Topology
from parallelism.comm import Rendezvous, host_store
from recovery.spec import TrainSpec
from recovery.worker import StageWorker


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


class ThreadedJob:
    """A whole job's workers in threads, driven step by step like the controller does."""

    def __init__(self, spec: TrainSpec, topology: Topology) -> None:
        self.topology = topology
        self.store = host_store("127.0.0.1")
        self.workers = [StageWorker() for _ in range(topology.world_size)]
        for rank, w in enumerate(self.workers):
            w.setup(spec, topology, rank, "gloo")
        self.generation = -1
        self.reform()

    def reform(self) -> None:
        self.generation += 1
        rdzv = Rendezvous("127.0.0.1", self.store.port, f"gen{self.generation}", 30)
        results = in_threads(
            [lambda w=w: w.join(self.generation, rdzv, "127.0.0.1") for w in self.workers]
        )
        assert all(isinstance(r, float) for r in results), results

    def step(self, step: int) -> float:
        reports = in_threads([lambda w=w: w.run_step(step) for w in self.workers])
        for r in reports:
            if isinstance(r, BaseException):
                raise r
            assert r.ok, r.error
        for w in self.workers:
            w.commit(step)
        total = sum(r.stats.loss_sum for r in reports)
        return total / sum(r.stats.losses for r in reports)

    def fit(self, steps: int) -> list[float]:
        return [self.step(s) for s in range(steps)]

    def state(self, stage: int, replica: int) -> dict[str, Any]:
        return self.workers[self.topology.rank(stage, replica)].state()["model"]  # type: ignore[return-value]

    def close(self) -> None:
        for w in self.workers:
            w.leave()
