"""Warm worker actors, kept between jobs of one driver process and as hot spares.

Starting a worker costs seconds (a Python process, ``import torch``, the first optimizer's
lazy imports); reusing one costs a round trip. When a job ends, its healthy workers are
reset (module, optimizer and process groups dropped) and parked here; the next job on the
same node takes them instead of starting new processes. Experiments and the test suite,
which run many short jobs in one process, start in a fraction of the time, and a
recovery can take a spare instead of waiting for a cold start.

The pool belongs to one Ray session: if Ray is restarted, the parked actors are gone and
the pool forgets them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import ray

PoolKey = tuple[str, Hashable]


class WorkerPool:
    """Parked, reset worker actors by (node, options).

    Args:
        max_idle: the most actors parked at once; more are killed on release.
    """

    def __init__(self, max_idle: int = 32) -> None:
        self.max_idle = max_idle
        self._idle: dict[PoolKey, list[Any]] = {}
        self._session: str | None = None

    def _check_session(self) -> None:
        session = ray.get_runtime_context().get_job_id() if ray.is_initialized() else None
        if session != self._session:
            self._idle.clear()
            self._session = session

    def take(self, node_id: str, options: Hashable) -> Any | None:
        """A parked actor for ``(node_id, options)``, or None. The caller checks it is alive."""
        self._check_session()
        parked = self._idle.get((node_id, options))
        return parked.pop() if parked else None

    def park(self, actor: Any, node_id: str, options: Hashable) -> None:
        """Park a reset actor (or kill it if the pool is full)."""
        self._check_session()
        if self.size() >= self.max_idle:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            return
        self._idle.setdefault((node_id, options), []).append(actor)

    def size(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def clear(self, kill: Callable[[Any], None] | None = None) -> None:
        """Forget (and kill) every parked actor."""
        for actors in self._idle.values():
            for actor in actors:
                with contextlib.suppress(Exception):
                    (kill or (lambda a: ray.kill(a, no_restart=True)))(actor)
        self._idle.clear()


POOL = WorkerPool()
"""The driver process's pool, shared by every `Trainer` in it."""
