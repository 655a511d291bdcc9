"""`RayWorkerGroup`: each worker a Ray actor, pinned to its node.

Actors ask Ray for no CPUs (several workers share a node and set their own torch threads)
and, under NCCL, one GPU. Placement is a correctness property (two replicas of a stage on
one node could both die with it, see recovery/placement.py), so every actor gets hard
node affinity. Healthy workers of a finished job are reset and parked in the driver's
`WorkerPool`, so the next job in the same process starts warm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from recovery.errors import CallbackError
from recovery.pool import POOL
from recovery.ray_env import alive_nodes, connect, driver_host
from recovery.runtime.group import (
    Call,
    CallResults,
    WorkerGroup,
    WorkerLost,
    expect_exit,
    seconds,
)
from recovery.worker import StageWorker, WorkerInfo

__all__ = ["RayWorkerGroup"]


_CLASSES_CACHE: dict[type, Any] = {}


def _remote_class(worker_cls: type[StageWorker]) -> Any:
    if worker_cls not in _CLASSES_CACHE:
        _CLASSES_CACHE[worker_cls] = _make_remote_class(worker_cls)
    return _CLASSES_CACHE[worker_cls]


def _make_remote_class(worker_cls: type[StageWorker]) -> Any:
    """``worker_cls`` as a Ray actor class whose ``probe`` and ``abort`` run on a separate
    control thread (answered while the worker is busy, or stuck, in a step)."""

    class Remote(worker_cls):  # type: ignore[valid-type, misc]
        @ray.method(concurrency_group="control")
        def probe(self) -> dict[str, object]:
            return StageWorker.probe(self)

        @ray.method(concurrency_group="control")
        def abort(self) -> None:
            StageWorker.abort(self)

    Remote.__name__ = Remote.__qualname__ = f"Remote{worker_cls.__name__}"
    return ray.remote(concurrency_groups={"control": 1})(Remote)  # type: ignore[call-overload]


class RayWorkerGroup(WorkerGroup):
    """Workers as Ray actors (see the module docstring).

    Args:
        worker_cls: the worker class (`StageWorker` or a subclass, from the state layout).
        threads: torch intra-op threads per worker.
        backend: ``"gloo"`` or ``"nccl"`` (an NCCL worker asks Ray for one GPU).
        options: extra ``.options()`` for every actor (tests, custom resources).
    """

    def __init__(
        self,
        worker_cls: type[StageWorker],
        *,
        threads: int = 1,
        backend: str = "gloo",
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.worker_cls = worker_cls
        self.threads = threads
        self.backend = backend
        self.options = dict(options or {})
        self._actors: dict[int, Any] = {}
        self._infos: dict[int, WorkerInfo] = {}
        self._spares: list[tuple[Any, str]] = []
        self._warming: dict[int, Any] = {}
        """``id(actor)`` of a spare -> its warm-up call, until `await_spares`."""
        self.started_ray = False
        """Whether `connect` started a local Ray (then everything is on 127.0.0.1)."""

    @classmethod
    def connect(cls, worker_cls: type[StageWorker], **kwargs: Any) -> RayWorkerGroup:
        """Connect to Ray (``RAY_ADDRESS``, as ``ray job submit`` sets) or start a local
        one, and make a group; ``kwargs`` as for the constructor."""
        started = connect()
        group = cls(worker_cls, **kwargs)
        group.started_ray = started
        return group

    def store_host(self) -> str:
        return "127.0.0.1" if self.started_ray else driver_host()

    def check_capacity(self, workers: int) -> None:
        # Under NCCL each worker asks Ray for a GPU: with too few, its actor would wait
        # for one until the start timeout instead of failing.
        if self.backend != "nccl":
            return
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus < workers:
            raise ValueError(
                f"backend 'nccl' needs one GPU per worker: the job needs {workers} (workers "
                f"and hot spares), the Ray cluster has {gpus}. Use backend='gloo' on CPUs, "
                "fewer workers, or add GPU nodes"
            )

    @property
    def _pool_key(self) -> tuple[Any, ...]:
        return (
            self.worker_cls.__name__,
            self.threads,
            self.backend,
            tuple(sorted(self.options.items())),
        )

    def _new_actor(self, node_id: str) -> Any:
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0}
        if self.backend == "nccl":
            options["num_gpus"] = 1  # Ray sets CUDA_VISIBLE_DEVICES: the worker's GPU is cuda:0
        options.update(self.options)
        if node_id:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id, soft=False, _fail_on_unavailable=True
            )
        return _remote_class(self.worker_cls).options(**options).remote(self.threads)

    # -- membership --------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return alive_nodes()

    def start(
        self,
        placement: Mapping[int, str],
        *,
        timeout: timedelta | float,
        spares: bool = False,
        parked: bool = False,
    ) -> tuple[CallResults, set[int]]:
        self.kill([r for r in placement if r in self._actors])
        actors: dict[int, Any] = {}
        warm: set[int] = set()
        for rank, node in placement.items():
            actor = self._take_spare(node) if spares else None
            if actor is None and parked:
                actor = POOL.take(node, self._pool_key)
            if actor is None:
                actor = self._new_actor(node)
            else:
                warm.add(rank)
            actors[rank] = actor
        infos = self._ask_info(actors, timeout)
        stale = {r for r in infos.lost if r in warm}
        if stale:  # parked actors or spares that died meanwhile: start fresh ones instead
            for rank in stale:
                actors[rank] = self._new_actor(placement[rank])
                warm.discard(rank)
            more = self._ask_info({r: actors[r] for r in stale}, timeout)
            for rank in stale:
                del infos.lost[rank]
            infos.results.update(more.results)
            infos.lost.update(more.lost)
        for rank, info in infos.results.items():
            self._actors[rank] = actors[rank]
            self._infos[rank] = info
        for rank in infos.lost:
            with contextlib.suppress(Exception):
                ray.kill(actors[rank], no_restart=True)
        return infos, warm & set(infos.results)

    def _ask_info(self, actors: Mapping[int, Any], timeout: timedelta | float) -> CallResults:
        refs = {rank: actor.info.remote() for rank, actor in actors.items()}
        return self._gather_refs(refs, seconds(timeout))

    def kill(self, ranks: Iterable[int]) -> None:
        for rank in list(ranks):
            actor = self._actors.pop(rank, None)
            info = self._infos.pop(rank, None)
            if info is not None:
                expect_exit(info.pid, "killed by the controller")
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)

    def info(self, rank: int) -> WorkerInfo:
        return self._infos[rank]

    def ranks(self) -> list[int]:
        return sorted(self._actors)

    # -- spares ------------------------------------------------------------------------

    def add_spares(
        self, nodes: Sequence[str], warm: Callable[[], tuple[str, tuple[Any, ...]]]
    ) -> None:
        for node in nodes:
            actor = POOL.take(node, self._pool_key) or self._new_actor(node)
            method, args = warm()
            self._warming[id(actor)] = getattr(actor, method).remote(*args)
            self._spares.append((actor, node))

    def await_spares(self, timeout: timedelta | float) -> int:
        got = self._gather_refs(self._warming, seconds(timeout))
        self._warming = {}
        failed = [sp for sp in self._spares if id(sp[0]) in got.lost]
        for actor, _node in failed:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._spares = [sp for sp in self._spares if id(sp[0]) not in got.lost]
        return len(self._spares)

    def spare_count(self) -> int:
        return len(self.spare_nodes())

    def spare_nodes(self) -> list[str]:
        alive = set(self.nodes())
        gone = [spare for spare in self._spares if spare[1] not in alive]
        for spare in gone:  # a spare on a lost node: forget it (and make sure it is gone)
            self._spares.remove(spare)
            actor = spare[0]
            self._warming.pop(id(actor), None)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        return [node for _, node in self._spares]

    def _take_spare(self, node: str) -> Any | None:
        """A spare on ``node`` (the caller's info() call awaits its warm-up), if any. Never
        one elsewhere: the placement chose ``node`` to keep a stage's replicas apart."""
        index = next((i for i, (_, n) in enumerate(self._spares) if n == node), None)
        if index is None:
            return None
        actor = self._spares.pop(index)[0]
        self._warming.pop(id(actor), None)
        return actor

    # -- calls -------------------------------------------------------------------------

    def submit(self, rank: int, method: str, *args: Any) -> Call:
        actor = self._actors.get(rank)
        if actor is None:
            return Call(rank, method, WorkerLost(rank, "no worker"))
        return Call(rank, method, getattr(actor, method).remote(*args))

    def wait(
        self, calls: Sequence[Call], timeout: timedelta | float, *, first: bool = False
    ) -> tuple[list[Call], list[Call]]:
        refs = [c.handle for c in calls if not isinstance(c.handle, WorkerLost)]
        if refs:
            ready, _ = ray.wait(
                refs, num_returns=1 if first else len(refs), timeout=max(0.0, seconds(timeout))
            )
        else:
            ready = []
        done = set(ready)
        finished = [c for c in calls if isinstance(c.handle, WorkerLost) or c.handle in done]
        return finished, [c for c in calls if c not in finished]

    def result(self, call: Call) -> Any:
        if isinstance(call.handle, WorkerLost):
            raise call.handle
        try:
            return ray.get(call.handle, timeout=0)
        except GetTimeoutError:
            raise WorkerLost(call.rank, f"{call.method} did not answer in time") from None
        except RayActorError as exc:
            text = str(exc).strip().splitlines()
            raise WorkerLost(
                call.rank, f"{type(exc).__name__}: {text[0][:300] if text else ''}"
            ) from None
        except RayTaskError as exc:
            if isinstance(exc.cause, CallbackError):  # the user's error, not the runtime's
                raise exc.cause from exc.cause.user_error
            raise exc.as_instanceof_cause() from None

    def _gather_refs(self, refs: Mapping[Any, Any], timeout_s: float) -> CallResults:
        calls = {
            key: Call(-1 if not isinstance(key, int) else key, "call", ref)
            for key, ref in refs.items()
        }
        return self.gather(calls, timeout_s)

    def shutdown(self, *, clean: bool) -> None:
        actors, self._actors = self._actors, {}
        infos, self._infos = self._infos, {}
        spares, self._spares = self._spares, []
        self._warming = {}
        keep: set[int] = set()
        if actors:  # workers that can still reset themselves are reused, whatever happened
            refs = {rank: actor.reset.remote() for rank, actor in actors.items()}
            with contextlib.suppress(Exception):
                keep = set(self._gather_refs(refs, 30.0 if clean else 5.0).results)
        for rank, actor in actors.items():
            if rank in keep:
                POOL.park(actor, infos[rank].node_id, self._pool_key)
            else:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        for actor, node in spares:
            POOL.park(actor, node, self._pool_key)
