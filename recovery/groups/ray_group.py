"""`RayWorkerGroup`: each worker a Ray actor, pinned to its node.

Actors ask Ray for what `Trainer(worker_resources=...)` says (recovery/groups/resources.py; by
default no CPU, as several workers share a node and set their own torch threads, and under
NCCL one GPU). Placement is a correctness property (two replicas of a stage on one node
could both die with it, see recovery/groups/placement.py), so every actor gets hard node
affinity. Healthy workers of a finished job are reset and parked in the driver's
`WorkerPool`, so the next job in the same process starts warm.

[Note: waiting for room]
A new actor either gets a worker process on its node (Ray's actor table then shows its
pid) or waits for the node to have room for its ask. A start that is placed but slow
(importing torch on a busy machine) is bounded by ``timeout``; one that is not placed at
all is bounded by ``place_timeout`` (``RecoveryPolicy.timeouts.replace``): then it
is killed and reported in ``CallResults.unplaced`` with what its node has free, instead of
waiting the start timeout for a node that may never have room.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import ray
from ray.exceptions import (
    ActorUnschedulableError,
    GetTimeoutError,
    RayActorError,
    RayTaskError,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from recovery.errors import CallbackError
from recovery.faults.exits import expect_exit
from recovery.groups.group import (
    Call,
    CallResults,
    Warmup,
    WorkerGroup,
    WorkerLost,
    seconds,
)
from recovery.groups.pool import POOL
from recovery.groups.ray_env import alive_nodes, connect, driver_host
from recovery.groups.resources import actor_options, describe, fits, worker_ask
from recovery.worker import StageWorker, WorkerInfo
from recovery.worker.memory import huge_page_env

__all__ = ["RayWorkerGroup"]

_PENDING = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION"})
_POLL_S = 0.25
_GIVE_WAY_S = 1.0
"""A new worker still not placed after this long makes the parked workers of earlier jobs
(which hold their asks' resources) give way: the pool is emptied."""


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
        def abort(self, generation: int | None = None, job: str = "") -> None:
            StageWorker.abort(self, generation, job)

    Remote.__name__ = Remote.__qualname__ = f"Remote{worker_cls.__name__}"
    return ray.remote(concurrency_groups={"control": 1})(Remote)  # type: ignore[call-overload]


class RayWorkerGroup(WorkerGroup):
    """Workers as Ray actors (see the module docstring).

    Args:
        worker_cls: the worker class (`StageWorker` or a subclass, from the state layout).
        threads: torch intra-op threads per worker.
        backend: ``"gloo"`` or ``"nccl"`` (an NCCL worker asks Ray for one GPU).
        device: the workers' compute device (parallelism/devices.py; a Gloo worker on
            ``"cuda"`` asks Ray for a share of a GPU, see recovery/groups/resources.py).
        resources: what each worker (and hot spare) asks Ray for, as
            `recovery.groups.resources.worker_ask` checks it; default: that function's default.
        options: extra ``.options()`` for every actor (tests).

    Raises:
        ValueError: for bad ``resources`` (see `recovery.groups.resources.worker_ask`).
    """

    def __init__(
        self,
        worker_cls: type[StageWorker],
        *,
        threads: int = 1,
        backend: str = "gloo",
        device: str | None = None,
        resources: Mapping[str, float] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.worker_cls = worker_cls
        self.threads = threads
        self.backend = backend
        self.device = device
        self.ask = worker_ask(resources, backend, device)
        """What each worker asks Ray for (resource name -> amount)."""
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
        # A job the nodes can never hold at once would wait for room that never comes: say
        # so before anything starts. (A node that is only busy is the start's business,
        # see [Note: waiting for room].)
        totals = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        holds = sum(fits(self.ask, total) for total in totals)
        if holds >= workers:
            return
        has = describe({k: sum(t.get(k, 0.0) for t in totals) for k in self.ask})
        if self.backend == "nccl" and set(self.ask) == {"GPU"} and self.ask["GPU"] == 1:
            raise ValueError(
                f"backend 'nccl' needs one GPU per worker: the job needs {workers} (workers "
                f"and hot spares), the Ray cluster has {int(holds)}. Use backend='gloo' on "
                "CPUs, fewer workers, or add GPU nodes"
            )
        raise ValueError(
            f"each worker asks for {describe(self.ask)} (worker_resources): the job needs "
            f"{workers} workers (hot spares included), the Ray cluster's nodes hold "
            f"{int(holds)} (they have {has} in all). Ask for less, run fewer workers, or add nodes"
        )

    @property
    def _pool_key(self) -> tuple[Any, ...]:
        return (
            self.worker_cls.__name__,
            self.threads,
            self.backend,
            self.device,
            tuple(sorted(self.ask.items())),
            tuple(sorted(self.options.items())),
        )

    def _new_actor(self, node_id: str, *, ahead: bool) -> Any:
        """A new worker actor on ``node_id``. ``ahead``: started before it is needed (at
        the job's start, or as a spare), when it gets huge pages (see [Note: huge pages
        for a worker's heap]); a replacement started in a recovery does not."""
        # With a GPU (or a share of one) asked for, Ray sets CUDA_VISIBLE_DEVICES: the
        # worker's GPU is cuda:0.
        options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
        options.update(actor_options(self.ask))
        options.update(self.options)
        env = huge_page_env() if ahead else {}
        if env:
            runtime_env = dict(options.get("runtime_env") or {})
            runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
            options["runtime_env"] = runtime_env
        if node_id:
            # Hard affinity: a dead node fails the actor at once (ActorUnschedulableError, a
            # lost worker); a full one makes it wait for room (see [Note: waiting for room]).
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return _remote_class(self.worker_cls).options(**options).remote(self.threads)

    # -- membership --------------------------------------------------------------------

    def nodes(self) -> list[str]:
        """The alive nodes that can hold a worker at all: a node without what each worker
        asks for (a head started with no CPUs, say) is never placed on."""
        if not self.ask:
            return alive_nodes()
        return sorted(
            n["NodeID"]
            for n in ray.nodes()
            if n.get("Alive") and fits(self.ask, n.get("Resources", {})) >= 1
        )

    def start(
        self,
        placement: Mapping[int, str],
        *,
        timeout: timedelta | float,
        place_timeout: timedelta | float | None = None,
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
                actor = self._new_actor(node, ahead=parked)
            else:
                warm.add(rank)
            actors[rank] = actor
        infos = self._ask_info(actors, timeout, place_timeout, placement)
        stale = {r for r in infos.lost if r in warm}
        if stale:  # parked actors or spares that died meanwhile: start fresh ones instead
            for rank in stale:
                actors[rank] = self._new_actor(placement[rank], ahead=parked)
                warm.discard(rank)
            more = self._ask_info({r: actors[r] for r in stale}, timeout, place_timeout, placement)
            for rank in stale:
                del infos.lost[rank]
            infos.results.update(more.results)
            infos.lost.update(more.lost)
            infos.unplaced.update(more.unplaced)
        for rank, info in infos.results.items():
            self._actors[rank] = actors[rank]
            self._infos[rank] = info
        for rank in [*infos.lost, *infos.unplaced]:
            with contextlib.suppress(Exception):
                ray.kill(actors[rank], no_restart=True)
        return infos, warm & set(infos.results)

    def _ask_info(
        self,
        actors: Mapping[int, Any],
        timeout: timedelta | float,
        place_timeout: timedelta | float | None,
        placement: Mapping[int, str],
    ) -> CallResults:
        refs = {rank: actor.info.remote() for rank, actor in actors.items()}
        unplaced = self._await_placed(refs, actors, timeout, place_timeout)
        got = self._gather_refs({r: ref for r, ref in refs.items() if r not in unplaced}, 0.0)
        for rank in unplaced:
            got.unplaced[rank] = self._no_room(placement.get(rank, ""), place_timeout)
        return got

    def _await_placed(
        self,
        refs: Mapping[Any, Any],
        actors: Mapping[Any, Any],
        timeout: timedelta | float,
        place_timeout: timedelta | float | None,
    ) -> set[Any]:
        """Wait for ``refs`` (calls on ``actors``, by the same keys) until ``timeout``; give
        up on the actors that Ray has not placed within ``place_timeout``, and return their
        keys (see [Note: waiting for room])."""
        now = time.monotonic()
        deadline = now + seconds(timeout)
        place_by = now + (seconds(place_timeout) if place_timeout is not None else math.inf)
        waiting = dict(refs)
        placed: set[Any] = set()
        unplaced: set[Any] = set()
        while waiting and time.monotonic() < deadline:
            left = max(0.0, min(deadline, time.monotonic() + _POLL_S) - time.monotonic())
            ready, _ = ray.wait(list(waiting.values()), num_returns=len(waiting), timeout=left)
            done = set(ready)
            waiting = {k: ref for k, ref in waiting.items() if ref not in done}
            if place_timeout is None:
                continue
            for key in [k for k in waiting if k not in placed]:
                if _is_placed(actors[key]):
                    placed.add(key)
                elif self.ask and POOL.size() and time.monotonic() > now + _GIVE_WAY_S:
                    POOL.clear()  # parked workers of earlier jobs hold room: they give way
                elif time.monotonic() >= place_by:
                    unplaced.add(key)
                    del waiting[key]
        return unplaced

    def _no_room(self, node: str, place_timeout: timedelta | float | None) -> str:
        """Why a worker for ``node`` was not placed: what the node has, against the ask."""
        within = f"not placed within {seconds(place_timeout or 0):g} s"
        alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        if node not in alive:
            return f"{within}: its node {node[:12]} is gone"
        total = alive[node].get("Resources", {})
        try:
            from ray._private.state import available_resources_per_node

            free = available_resources_per_node().get(node, {})
        except Exception:  # an older Ray: say what the node has in all
            free = {}
        ask = describe(self.ask)
        if fits(self.ask, total) < 1:
            has = describe({k: total.get(k, 0.0) for k in self.ask})
            return f"{within}: node {node[:12]} can never hold a worker asking {ask} (it has {has})"
        free_text = describe({k: free.get(k, 0.0) for k in self.ask})
        return f"{within}: no room on node {node[:12]} for {ask} (free: {free_text})"

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

    def add_spares(self, nodes: Sequence[str], warm: Warmup) -> None:
        for node in nodes:
            actor = POOL.take(node, self._pool_key) or self._new_actor(node, ahead=True)
            method, args = warm()
            self._warming[id(actor)] = getattr(actor, method.__name__).remote(*args)
            self._spares.append((actor, node))

    def await_spares(
        self, timeout: timedelta | float, place_timeout: timedelta | float | None = None
    ) -> int:
        by_id = {id(actor): actor for actor, _ in self._spares}
        actors = {key: by_id[key] for key in self._warming if key in by_id}
        unplaced = self._await_placed(self._warming, actors, timeout, place_timeout)
        ready = {key: ref for key, ref in self._warming.items() if key not in unplaced}
        got = self._gather_refs(ready, 0.0)
        got.lost.update({key: WorkerLost(-1, "not placed") for key in unplaced})
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
        gone = [spare for spare in self._spares if spare[1] and spare[1] not in alive]
        for spare in gone:  # a spare on a lost node: forget it (and make sure it is gone)
            self._spares.remove(spare)
            actor = spare[0]
            self._warming.pop(id(actor), None)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        return [node for _, node in self._spares]

    def ready_spare_nodes(self) -> list[str]:
        self.spare_nodes()  # forget the spares of lost nodes first
        ready: list[str] = []
        for index, (actor, node) in enumerate(list(self._spares)):
            ref = self._warming.get(id(actor))
            try:
                if ref is not None:
                    done, _ = ray.wait([ref], timeout=0)
                    if not done:
                        continue
                    ray.get(ref)
                    del self._warming[id(actor)]
                if not node:  # placed wherever there was room: ask where
                    node = ray.get(actor.info.remote(), timeout=_POLL_S * 10).node_id
                    self._spares[index] = (actor, node)
            except Exception:  # died or failed warming up: no spare
                self._warming.pop(id(actor), None)
                self._spares[index] = (actor, "<dead>")
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                continue
            ready.append(node)
        self._spares = [sp for sp in self._spares if sp[1] != "<dead>"]
        return ready

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

    def _send(self, rank: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        actor = self._actors.get(rank)
        if actor is None:
            return Call(rank, name, WorkerLost(rank, "no worker"))
        return Call(rank, name, getattr(actor, name).remote(*args, **kwargs))

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
        except (RayActorError, ActorUnschedulableError) as exc:
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


def _is_placed(actor: Any) -> bool:
    """Whether Ray has given ``actor`` a worker process (or finished with it: alive or
    dead), from the GCS actor table; an unreadable table counts as placed, which leaves
    only the start timeout, as before."""
    try:
        from ray._private.state import actors

        entry = actors(actor._actor_id.hex())
    except Exception:
        return True
    return not (entry.get("State") in _PENDING and not entry.get("Pid"))
