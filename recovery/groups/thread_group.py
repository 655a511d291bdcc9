"""`ThreadWorkerGroup`: each worker a thread of this process -- the runtime without Ray.

Each worker is a real `StageWorker` (or subclass) that forms its own Gloo process groups
on the controller's store, exactly as under Ray, so the controller, the engine, the
schedules and the state transfers all run for real; only the process boundary is
simulated. That makes every controller transition testable in milliseconds.

What a process death is here: an injected `Kill` raises `_ThreadKilled` inside the worker
(instead of SIGKILL), and `kill()` marks the worker dead; either way its process groups
are torn down at once, so its peers see the same "connection reset" a real death gives
them, and every call on it -- a call in flight included, as with a dead Ray actor -- is a
`WorkerLost`. An injected hang blocks until the worker is killed. Nodes are names
(``"node-0"``, ...); `remove_node` loses one with every worker on it, `add_node` adds one.
With ``slots`` a node holds that many workers and spares: a worker that finds no room is
unplaced, and a spare asked for anywhere waits for room (as Ray's do). `chaos` kills
workers from outside, at points the controller does not know about (tests of failures
during a recovery).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from parallelism.seeding import GENERATORS_LOCK, ThreadRandomness
from recovery.groups.group import (
    CONTROL_METHODS,
    Call,
    CallResults,
    Warmup,
    WorkerGroup,
    WorkerLost,
    seconds,
)
from recovery.worker import StageWorker, WorkerInfo

__all__ = ["ThreadWorkerGroup"]

log = logging.getLogger("checkfree")


_SEEDING = frozenset({"setup", "warm", "rebuild"})
"""Methods that seed torch's global RNG and build from it: one at a time in a process
whose workers share that RNG (under Ray each worker has a process of its own)."""


class _ThreadKilled(BaseException):
    """An injected death inside a thread worker (a BaseException: no `except Exception`
    in user or engine code may swallow it)."""


_CLASSES_CACHE: dict[type, Any] = {}


def _thread_class(worker_cls: type[StageWorker]) -> type[StageWorker]:
    if worker_cls not in _CLASSES_CACHE:
        _CLASSES_CACHE[worker_cls] = _make_thread_class(worker_cls)
    return _CLASSES_CACHE[worker_cls]


def _make_thread_class(worker_cls: type[StageWorker]) -> type[StageWorker]:
    class Threaded(worker_cls):  # type: ignore[valid-type, misc]
        released: threading.Event

        def __init__(self, threads: int = 1) -> None:
            super().__init__(threads)
            self.rng = ThreadRandomness()  # streams of its own, as a process has

        def _die(self) -> None:
            raise _ThreadKilled

        def _hang(self) -> None:
            self.released.wait()
            raise _ThreadKilled

    Threaded.__name__ = Threaded.__qualname__ = f"Threaded{worker_cls.__name__}"
    return Threaded


def current_frames() -> dict[int, Any]:
    """`sys._current_frames`, with the garbage collector held off while it runs.

    CPython before 3.11.9 (cpython#106883) collects garbage inside it while holding the
    runtime's thread-list lock. Collected there, a Gloo work of a killed worker (held by
    the traceback cycle of the error that ended its call) runs its C++ destructor without
    the GIL and takes the GIL back to drop a tensor, while the thread that holds the GIL
    waits for that lock to start or end a thread: the process stops for good, every thread
    blocked, signals and timers included. Seen here as a test that hung a CI run for the
    rest of its 90 minutes; py-spy showed exactly that main thread. CPython's own fix
    holds the collector off the same way.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def _log_where(rank: int, worker: _Worker) -> None:
    """Log where a worker killed in the middle of a call was (a hang, most often): a
    process would take that with it, a thread can still show it."""
    frames = current_frames()
    for thread in getattr(worker.main, "_threads", ()):
        frame = frames.get(thread.ident or -1)
        stack = traceback.extract_stack(frame) if frame is not None else []
        if any(f.name == "_run" and f.filename == __file__ for f in stack):
            where = "".join(traceback.format_list(stack[-12:]))
            log.warning("killing worker rank %d in the middle of a call, at:\n%s", rank, where)


@dataclass(eq=False)
class _Worker:
    worker: StageWorker
    node: str
    main: ThreadPoolExecutor
    control: ThreadPoolExecutor
    dead: threading.Event = field(default_factory=threading.Event)

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(pid=os.getpid(), node_id=self.node, host="127.0.0.1")


class ThreadWorkerGroup(WorkerGroup):
    """Workers as threads of this process (see the module docstring).

    Args:
        worker_cls: the worker class (from the state layout).
        nodes: names of the simulated nodes.
        threads: torch intra-op threads (process-wide here).
    """

    def __init__(
        self,
        worker_cls: type[StageWorker],
        *,
        nodes: Sequence[str] = ("node-0",),
        threads: int = 1,
        slots: int | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("ThreadWorkerGroup needs at least one node")
        self.worker_cls = _thread_class(worker_cls)
        self.threads = threads
        self._nodes = list(nodes)
        self._workers: dict[int, _Worker] = {}
        self._spares: list[_Worker] = []
        self._warming: dict[int, Future[Any]] = {}
        self.slots = slots
        """Workers and spares a node holds (None: any number)."""
        self._waiting: list[Warmup] = []
        """Spares asked for anywhere that found no room yet (their warm-up calls)."""
        self.started = 0
        """Workers created so far (spares included): what a test counts to see reuse."""
        self.spare_gate: threading.Event | None = None
        """Spares finish warming up only once this is set (None: at once) -- a spare that
        takes its time, as a real one does (tests of a job that trains shrunk)."""
        self.chaos: Callable[[int, str], float | None] | None = None
        """An outside killer: called with (rank, method) as each call starts; a number
        kills that worker so many seconds later, from another thread, without telling the
        controller (it finds out as it would from a real death)."""

    def _new(self, node: str) -> _Worker:
        self.started += 1
        worker = self.worker_cls(self.threads)
        worker.released = threading.Event()  # type: ignore[attr-defined]
        name = f"worker-{self.started}"
        return _Worker(
            worker=worker,
            node=node,
            main=ThreadPoolExecutor(1, thread_name_prefix=name),
            control=ThreadPoolExecutor(1, thread_name_prefix=f"{name}-control"),
        )

    # -- membership --------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return list(self._nodes)

    def add_node(self, node: str) -> None:
        """A node joins (with room for ``slots`` workers): spares waiting for room go there."""
        self._nodes.append(node)
        self._place_waiting()

    def _room(self, node: str) -> bool:
        if self.slots is None:
            return True
        held = sum(w.node == node for w in self._workers.values() if not w.dead.is_set())
        held += sum(s.node == node for s in self._spares if not s.dead.is_set())
        return held < self.slots

    def _place_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for warm in waiting:
            node = next((n for n in self._nodes if self._room(n)), None)
            if node is None:
                self._waiting.append(warm)
            else:
                self._start_spare(node, warm)

    def remove_node(self, node: str) -> list[int]:
        """Lose ``node``: every worker and spare on it dies. Returns the ranks lost."""
        self._nodes.remove(node)
        ranks = [r for r, w in self._workers.items() if w.node == node]
        for rank in ranks:
            self._kill(self._workers[rank])
        for spare in [s for s in self._spares if s.node == node]:
            self._kill(spare)
        return ranks

    def start(
        self,
        placement: Mapping[int, str],
        *,
        timeout: timedelta | float,
        place_timeout: timedelta | float | None = None,
        spares: bool = False,
        parked: bool = False,
    ) -> tuple[CallResults, set[int]]:
        # Threads need no room: a worker is placed at once (and asks for no resources,
        # so Trainer(worker_resources=...) does not apply here).
        del place_timeout
        out = CallResults()
        warm: set[int] = set()
        for rank, node in placement.items():
            old = self._workers.pop(rank, None)
            if old is not None:
                self._kill(old)
            if node not in self._nodes:
                out.lost[rank] = WorkerLost(rank, f"node {node} is not alive")
                continue
            worker = self._take_spare(node) if spares else None
            if worker is None and not self._room(node):
                out.unplaced[rank] = f"no room on node {node} ({self.slots} slots, all held)"
                continue
            if worker is None:
                worker = self._new(node)
            else:
                warm.add(rank)
            self._workers[rank] = worker
            out.results[rank] = worker.info
        return out, warm

    def _take_spare(self, node: str) -> _Worker | None:
        spare = next((s for s in self._spares if s.node == node and not s.dead.is_set()), None)
        if spare is None:
            return None
        self._spares.remove(spare)
        warming = self._warming.pop(id(spare), None)
        if warming is not None:
            wait_futures([warming])
        return spare

    def kill(self, ranks: Iterable[int]) -> None:
        for rank in list(ranks):
            worker = self._workers.pop(rank, None)
            if worker is not None:
                _log_where(rank, worker)
                self._kill(worker)

    def _kill(self, worker: _Worker) -> None:
        """A death: the worker stops answering and its process groups go down."""
        worker.dead.set()
        worker.worker.released.set()  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            # Every generation of this job, the one it may be about to join included: a
            # thread cannot be stopped, and a join it began after the abort would otherwise
            # sit on the store until the store's timeout, holding the formation up (a
            # process killed there takes its sockets with it).
            worker.worker.abort(sys.maxsize, self.job)

    def info(self, rank: int) -> WorkerInfo:
        return self._workers[rank].info

    def ranks(self) -> list[int]:
        return sorted(self._workers)  # like Ray: a worker that died on its own stays until killed

    def alive(self, rank: int) -> bool:
        """Whether ``rank`` has a live worker (a test's view; the controller never asks)."""
        worker = self._workers.get(rank)
        return worker is not None and not worker.dead.is_set()

    # -- spares ------------------------------------------------------------------------

    def add_spares(self, nodes: Sequence[str], warm: Warmup) -> None:
        for node in nodes:
            if node:
                self._start_spare(node, warm)
            else:
                self._waiting.append(warm)
        self._place_waiting()

    def _start_spare(self, node: str, warm: Warmup) -> None:
        spare = self._new(node)
        method, args = warm()
        gate = self.spare_gate

        def warm_up() -> Any:
            if gate is not None:
                gate.wait()
            return self._run(spare, method.__name__, args, {})

        self._warming[id(spare)] = spare.main.submit(warm_up)
        self._spares.append(spare)

    def await_spares(
        self, timeout: timedelta | float, place_timeout: timedelta | float | None = None
    ) -> int:
        del place_timeout  # placed at once
        futures = dict(self._warming)
        self._warming = {}
        wait_futures(list(futures.values()), timeout=seconds(timeout))
        for spare in list(self._spares):
            future = futures.get(id(spare))
            if future is not None and (not future.done() or future.exception() is not None):
                self._kill(spare)
                self._spares.remove(spare)
        return len(self._spares)

    def spare_count(self) -> int:
        return len(self._spares) + len(self._waiting)

    def spare_nodes(self) -> list[str]:
        return [s.node for s in self._spares if not s.dead.is_set()]

    def ready_spare_nodes(self) -> list[str]:
        self._place_waiting()
        ready = []
        for spare in list(self._spares):
            warming = self._warming.get(id(spare))
            if warming is not None and not warming.done():
                continue
            if spare.dead.is_set() or (warming is not None and warming.exception() is not None):
                self._kill(spare)
                self._spares.remove(spare)
                continue
            ready.append(spare.node)
        return ready

    # -- calls -------------------------------------------------------------------------

    def _run(
        self, worker: _Worker, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if worker.dead.is_set():
            raise _ThreadKilled
        delay = self.chaos(self._rank_of(worker), method) if self.chaos is not None else None
        if delay is not None:
            threading.Timer(delay, self._kill, (worker,)).start()
        try:
            if method in _SEEDING:
                with GENERATORS_LOCK:
                    out = getattr(worker.worker, method)(*args, **kwargs)
            else:
                out = getattr(worker.worker, method)(*args, **kwargs)
        except _ThreadKilled:
            self._kill(worker)
            raise
        except BaseException:
            if worker.dead.is_set():  # killed meanwhile: a dead process reports nothing
                raise _ThreadKilled from None
            raise
        if worker.dead.is_set() and method not in CONTROL_METHODS:
            raise _ThreadKilled
        return out

    def _rank_of(self, worker: _Worker) -> int:
        return next((r for r, w in self._workers.items() if w is worker), -1)

    def _send(self, rank: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        worker = self._workers.get(rank)
        if worker is None or worker.dead.is_set():
            return Call(rank, name, WorkerLost(rank, "the worker is dead"))
        pool = worker.control if name in CONTROL_METHODS else worker.main
        return Call(rank, name, (worker, pool.submit(self._run, worker, name, args, kwargs)))

    def wait(
        self, calls: Sequence[Call], timeout: timedelta | float, *, first: bool = False
    ) -> tuple[list[Call], list[Call]]:
        deadline = time.monotonic() + max(0.0, seconds(timeout))
        when = "FIRST_COMPLETED" if first else "ALL_COMPLETED"
        while True:
            finished = [c for c in calls if self._finished(c)]
            left = deadline - time.monotonic()
            if len(finished) == len(calls) or (first and finished) or left <= 0:
                return finished, [c for c in calls if c not in finished]
            # A death does not complete a future: look at the dead flags every few ms.
            futures = [c.handle[1] for c in calls if c not in finished]
            wait_futures(futures, timeout=min(left, 0.02), return_when=when)

    @staticmethod
    def _finished(call: Call) -> bool:
        if isinstance(call.handle, WorkerLost):
            return True
        worker, future = call.handle
        return bool(future.done() or (worker.dead.is_set() and call.method not in CONTROL_METHODS))

    def result(self, call: Call) -> Any:
        if isinstance(call.handle, WorkerLost):
            raise call.handle
        worker, future = call.handle
        if not future.done():
            if worker.dead.is_set():
                raise WorkerLost(call.rank, f"the worker died during {call.method}")
            raise WorkerLost(call.rank, f"{call.method} did not answer in time")
        error = future.exception()
        if isinstance(error, _ThreadKilled):
            raise WorkerLost(call.rank, f"the worker died during {call.method}")
        if error is not None:
            raise error
        return future.result()

    def shutdown(self, *, clean: bool) -> None:
        if self.spare_gate is not None:
            self.spare_gate.set()  # no spare is left waiting on it
        workers = list(self._workers.values()) + self._spares
        self._workers, self._spares, self._warming, self._waiting = {}, [], {}, []
        for worker in workers:
            self._kill(worker)
            with contextlib.suppress(Exception):
                worker.worker.leave()
            worker.main.shutdown(wait=False, cancel_futures=True)
            worker.control.shutdown(wait=False, cancel_futures=True)
