"""Process groups built, aborted, disposed of and waited on, apart from any one worker.

`StageComm` builds each of its groups with `_make_group` (Gloo or NCCL, see [Note: NCCL
groups that abort] and [Note: abandoning a formation]), aborts them with `abort_groups`
and hands them to `_REAPER` to be destroyed where a stuck destructor holds up nothing
([Note: process groups die on a thread of their own]); `_Waiter` waits on a
point-to-point work for a caller that must be able to give up.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parallelism.comm.wire import Waitable

BACKENDS = ("gloo", "nccl")


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str) -> torch.device:
    """The device a worker computes on for ``backend``.

    Raises:
        ValueError: for an unknown backend, or ``nccl`` without CUDA.
    """
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES, so device 0 is ours.
        return torch.device("cuda", 0)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


_WAIT_SLICE = datetime.timedelta(milliseconds=100)
_SLICE_TIMEOUT = "Operation timed out"
"""What c10d's ``Work.wait(timeout)`` raises when the slice runs out (the work goes on)."""

# Backend process-group objects (ProcessGroupGloo / ProcessGroupNCCL): their Python stubs do
# not share a useful base type, so they are typed loosely.
_Group = Any


# [Note: NCCL groups that abort]
# By default ProcessGroupNCCL's watchdog turns a timed-out or failed collective into a
# SIGABRT of the whole process (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), and its heartbeat
# monitor kills a process whose watchdog is stuck (TORCH_NCCL_ENABLE_MONITORING=1): a
# survivor blocked on a dead or hung peer would die instead of being told to abort. Here
# the controller decides (docs/timeouts.md): `NCCL_ENV` turns both off before any NCCL
# group is built; the groups' own timeout (``Rendezvous.collective_s``) is set above the
# controller's hang timeout, so it never fires first; communicators are non-blocking
# (``config.blocking = False``: an abort returns instead of waiting on a stuck kernel) and
# initialised eagerly on the worker's GPU (``device_id``: a failed join is seen while
# joining, not at the first collective); and `abort_groups` aborts all of a worker's
# communicators inside one NCCL group call, since aborting them one after another can
# deadlock (pytorch#119797). Every NCCL-only attribute is looked up with a guard, so an
# older torch builds what it can. None of this has run on a GPU yet (scripts/gpu_check.py).

NCCL_ENV: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # the watchdog neither aborts nor kills
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # no heartbeat monitor to kill a stuck watchdog
    "TORCH_NCCL_BLOCKING_WAIT": "0",  # work.wait() is a stream wait; progress is polled
}
"""The environment an NCCL worker builds its groups in (see [Note: NCCL groups that abort])."""


@dataclass(frozen=True)
class NcclSettings:
    """How this worker's NCCL process groups are built (see [Note: NCCL groups that abort])."""

    timeout: datetime.timedelta
    """c10d's own timeout: above the controller's hang timeout."""
    device: torch.device
    """The worker's GPU: communicators are created eagerly on it."""
    blocking: bool = False
    """Non-blocking communicators, so that an abort does not wait on a stuck kernel."""


def nccl_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """Set `NCCL_ENV` in ``environ`` (before any NCCL group is built: torch reads it then);
    returns the values it replaced, by name (absent ones as ``""``)."""
    replaced = {k: environ.get(k, "") for k, v in NCCL_ENV.items() if environ.get(k) != v}
    environ.update(NCCL_ENV)
    return replaced


def nccl_options(settings: NcclSettings, opts: Any) -> Any:
    """Fill a ``ProcessGroupNCCL.Options`` (or a stand-in in tests) from ``settings``;
    attributes this torch's build lacks are skipped. Returns ``opts``."""
    opts._timeout = settings.timeout
    config = getattr(opts, "config", None)
    if config is not None and hasattr(config, "blocking"):
        config.blocking = int(settings.blocking)
    return opts


def _connect_eagerly(group: _Group, device: torch.device) -> None:
    """Create ``group``'s communicator on ``device`` now (what ``init_process_group(device_id=)``
    does), where this torch can."""
    if hasattr(group, "eager_connect_single_device"):
        group.eager_connect_single_device(device)


def abort_groups(groups: list[_Group]) -> None:
    """Abort every one of a worker's process groups (see [Note: tearing down on failure]).

    NCCL groups are aborted together, inside one ``ncclGroupStart``/``ncclGroupEnd``
    (aborting communicators one after another can deadlock, pytorch#119797); others one by
    one. A group that refuses to abort (already broken) is skipped: its peers are told by
    the controller, and a Gloo group's connections are cut anyway.
    """
    nccl = [g for g in groups if hasattr(g, "_group_start")]
    rest = [g for g in groups if not hasattr(g, "_group_start")]
    if nccl:
        with contextlib.suppress(Exception):
            nccl[0]._group_start()
        for group in nccl:
            with contextlib.suppress(Exception):
                group.abort()
        with contextlib.suppress(Exception):
            nccl[0]._group_end()
    for group in rest:
        with contextlib.suppress(Exception):
            group.abort()


# [Note: abandoning a formation]
# Gloo connects a group's pairs inside ProcessGroupGloo's constructor, after the addresses
# went through the generation's store. A peer that died (or gave up) after publishing its
# address is waited for there, pair by pair, each for the group's timeout -- and dropping
# the store, which fails every wait *on* it at once, no longer reaches that wait. So:
# - the formation's waits are bounded by the join timeout (``formation``), not by the much
#   longer collective one, which the group gets once it is formed (`_set_default_timeout`);
# - the constructor runs on a helper thread, and the joiner waits for it in slices,
#   giving up as soon as ``cancel`` is set: the controller tells every joiner still
#   pending to abort when a formation fails (`Membership.form_generation`), and the
#   worker's `abort` sets it. The abandoned constructor finishes or times out on its
#   thread and its group is dropped; nothing of it is ever used.

_FORMATION_SLICE_S = 0.05


def _abandonable(build: Callable[[], _Group], cancel: threading.Event | None) -> _Group:
    """``build()``, or a communication error as soon as ``cancel`` is set (see
    [Note: abandoning a formation])."""
    if cancel is None:
        return build()
    if cancel.is_set():
        raise RuntimeError("gloo group formation abandoned: the generation was given up")
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["group"] = build()
        except BaseException as exc:  # handed to the joiner, unless it has given up
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="checkfree-formation", daemon=True).start()
    while not done.wait(_FORMATION_SLICE_S):
        if cancel.is_set():
            raise RuntimeError(
                "gloo group formation abandoned: the generation was given up while a "
                "connection to a peer was still pending"
            )
    if "error" in box:
        raise box["error"]
    return box["group"]


def _make_group(
    backend: str,
    store: dist.Store,
    rank: int,
    size: int,
    bind_host: str,
    timeout: datetime.timedelta,
    device: torch.device | None = None,
    *,
    formation: datetime.timedelta | None = None,
    cancel: threading.Event | None = None,
) -> _Group:
    """A process group whose operations time out after ``timeout`` (c10d's own, a
    backstop: docs/timeouts.md); for Gloo, see [Note: abandoning a formation] for
    ``formation`` (default ``timeout``) and ``cancel``.
    """
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = formation or timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        group = _abandonable(lambda: dist.ProcessGroupGloo(store, rank, size, opts), cancel)
        if formation is not None and formation != timeout:
            group._set_default_timeout(timeout)
        return group
    if backend == "nccl":
        gpu = device or torch.device("cuda", torch.cuda.current_device())
        settings = NcclSettings(timeout=timeout, device=gpu)
        nccl_env(os.environ)
        opts_nccl = nccl_options(settings, dist.ProcessGroupNCCL.Options())
        group = dist.ProcessGroupNCCL(store, rank, size, opts_nccl)
        _connect_eagerly(group, settings.device)
        return group
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


# [Note: process groups die on a thread of their own]
# Destroying a Gloo group joins its threads, and a thread still waiting inside an operation
# that nothing wakes (a peer that is alive but gone elsewhere) holds the join until the
# operation's timeout -- minutes. Where the last reference to a closed group goes, its
# destructor runs: in a worker's step thread, when an exception that ended a step is
# dropped (its traceback's frames hold a group's bound method), or wherever the garbage
# collector finds a cycle -- and there it stalls the worker (with workers as threads of
# one process, one that holds a lock everyone needs stalls them all). So `StageComm.close`
# hands its groups to `_Reaper`, which holds them until nothing else refers to them and
# then drops each on a daemon thread of its own: a destructor that waits, waits there,
# and holds up nothing else (not even the next group's).


def _drop(box: list[_Group]) -> None:
    box.pop()  # the last reference: the group's destructor runs on this thread


class _Reaper:
    """Holds closed process groups and drops each once it alone refers to it, each on a
    daemon thread of its own (see [Note: process groups die on a thread of their own])."""

    _POLL_S = 0.2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: list[_Group] = []
        self._thread: threading.Thread | None = None

    def bury(self, groups: list[_Group]) -> None:
        with self._lock:
            self._groups.extend(groups)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="checkfree-reaper", daemon=True
                )
                self._thread.start()
        groups.clear()

    def _run(self) -> None:
        while True:
            time.sleep(self._POLL_S)
            with self._lock:
                # 3 references: the list's, the loop's and getrefcount's own argument
                done = [g for g in self._groups if sys.getrefcount(g) <= 3]
                self._groups = [g for g in self._groups if all(g is not d for d in done)]
            while done:
                box = [done.pop()]
                threading.Thread(target=_drop, args=(box,), name="drop-group", daemon=True).start()
                del box


_REAPER = _Reaper()


class _Waiter:
    """A thread that waits on point-to-point works for a caller that must be able to give
    up (see `StageComm._wait_point_to_point`). One work at a time, in order; a work the
    caller gave up on keeps the thread until Gloo ends it (its connections are cut: soon,
    or at Gloo's timeout), after which the thread serves the next, or ends if `retire`d
    (its comm closed: without that, every generation of every worker left a thread behind,
    hundreds in a test process that runs thread-group jobs)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[
            tuple[Waitable, threading.Event, list[BaseException]] | None
        ] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="checkfree-p2p-wait", daemon=True).start()

    def retire(self) -> None:
        """End the thread once the works handed to it so far are done (idempotent)."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, done, error = item
            try:
                work.wait()
            except BaseException as exc:  # handed to the caller
                error.append(exc)
            finally:
                done.set()
            del item, work, done, error

    def wait(self, work: Waitable, given_up: Callable[[], bool]) -> bool:
        """Wait for ``work`` (raising its error); False once ``given_up()`` says to stop."""
        done = threading.Event()
        error: list[BaseException] = []
        self._queue.put((work, done, error))
        while not done.wait(_WAIT_SLICE.total_seconds()):
            if given_up():
                return False
        if error:
            raise error[0]
        return True
