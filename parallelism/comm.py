"""The process groups one worker uses during one generation of a job.

A generation is one membership epoch: a fixed set of live workers with fresh process
groups formed on a fresh key prefix of the controller's store. `StageComm` builds the
groups of one worker -- the world group (point-to-point inside a pipeline, state
transfer between any two workers) and its stage group (gradient all-reduce across the
replicas of its stage), plus the commit vote's TCP mesh (`parallelism.mesh`) -- and tears
them down with `close`. Process-group objects are
constructed directly rather than through ``torch.distributed.init_process_group`` so that
no global state survives a generation: closing one and forming the next is just dropping
objects, and a test can run several workers' groups in one process.

[Note: tearing down on failure]
Gloo wakes a survivor blocked on a dead peer within a fraction of a second ("Connection
closed by peer"), but it does not wake a survivor blocked on a *live* peer that has given
up, and neither ``abort()`` nor ``shutdown()`` of a Gloo group wakes anything: they do not
close its sockets while an operation is pending (measured on torch 2.13). So `close`
shuts down the group's TCP connections itself (`_Transport`): every operation of this
worker fails at once, whichever thread waits on it, and every peer waiting on this worker
sees the connection close and fails too. A worker that sees a communication error closes
at once, and the controller tells all others to close as soon as one fails, so every
survivor leaves the failed step within milliseconds of the first error instead of when the
failure reaches it through the schedule. Timeouts (``timeout``) remain the backstop for
hangs, which the controller handles by killing the hung worker. NCCL needs none of this:
``ProcessGroupNCCL.abort()`` aborts its communicators (all of a worker's at once, see
[Note: NCCL groups that abort]).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parallelism.devices import wire_device
from parallelism.mesh import Mesh
from parallelism.progress import Progress, progress_for
from parallelism.topology import Topology

BACKENDS = ("gloo", "nccl")


class GarbledMessage(ConnectionError):
    """Bytes from a peer that are not a message this runtime sends: a header out of bounds
    or that does not decode (what a receive buffer holds after the sender aborted
    mid-message, or what a stranger sends). A communication error, like a lost peer."""


Activation = torch.Tensor | tuple[torch.Tensor, ...]
"""What one stage passes to the next: one tensor, or a tuple of tensors."""

# dtype codes for activation metadata headers (see `send_activation`).
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8
_HEADER_LEN = 4 + _MAX_DIMS  # ndim, dtype, tuple size, requires grad, shape
_MAX_TUPLE = 64  # tensors in one activation
_MAX_ELEMENTS = 1 << 36  # elements in one activation tensor (256 GiB of float32)


def empty_received(
    shape: list[int] | tuple[int, ...], dtype: torch.dtype, device: torch.device, what: str
) -> torch.Tensor:
    """An uninitialised tensor for what a received header announces (already checked
    against its bounds).

    Raises:
        GarbledMessage: if it cannot be allocated: in bounds is not the same as possible
            (a garbled header can still ask for hundreds of GiB), and a failed allocation
            would otherwise read as a bug in user code and end the job.
    """
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as err:
        first = str(err).strip().splitlines()
        raise GarbledMessage(
            f"{what} announces a {dtype} tensor of shape {list(shape)} that cannot be "
            f"allocated on {device} ({first[-1][:200] if first else type(err).__name__}): a "
            "garbled header, or a message larger than this device's free memory"
        ) from None


def wire_buffer(like: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """An uninitialised tensor shaped as ``like`` on ``wire``: pinned host memory when
    ``like`` is on CUDA and ``wire`` is the host (so copies to and from it are DMAs)."""
    pinned = wire.type == "cpu" and like.device.type == "cuda"
    return torch.empty(like.shape, dtype=like.dtype, device=wire, pin_memory=pinned)


def to_wire(tensor: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """``tensor`` where the backend moves bytes (``wire``): itself when it is there already,
    else a copy -- in pinned host memory when staging a CUDA tensor for Gloo, so that the
    copy is a DMA and the send reads it at once (issue 15 item 5: compute on CUDA,
    communication over Gloo). The copy is finished when this returns."""
    if tensor.device == wire:
        return tensor.contiguous()
    staged = wire_buffer(tensor, wire)
    staged.copy_(tensor)
    return staged


def from_wire(received: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What arrived on the wire, on the compute ``device``: itself when it is there, else a
    copy (asynchronous from pinned memory: later work on ``device``'s stream is ordered
    after it)."""
    if received.device == device:
        return received
    return received.to(device, non_blocking=received.is_pinned())


def land(target: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Copy what arrived on the wire into ``target`` on the compute device (asynchronous
    from pinned memory, as `from_wire`); returns ``target``."""
    if received is not target:
        target.copy_(received, non_blocking=received.is_pinned())
    return target


class StagedWork:
    """A collective run on a wire copy of a compute-device tensor: waiting for it copies the
    result back (see [Note: compute device and wire device] in parallelism/devices.py).
    Anything else is the backend work's own."""

    def __init__(self, work: dist.Work, staged: torch.Tensor, target: torch.Tensor) -> None:
        self._work = work
        self._staged = staged
        self._target = target
        self._landed = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for the collective (at most ``timeout``: the backend raises when it runs
        out), then copy the result into the compute-device tensor, once."""
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._landed:
            land(self._target, self._staged)
            self._landed = True
        return bool(done)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


Waitable = dist.Work | StagedWork
"""What a started collective returns: the backend's work, or a staged one."""


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


@dataclass(frozen=True)
class Rendezvous:
    """Where and under which key prefix the workers of one generation meet."""

    host: str
    port: int
    prefix: str
    timeout_s: float = 60.0
    """Joining: the store's timeout, and so how long forming the groups may take."""
    collective_s: float | None = None
    """The process groups' own timeout (c10d's), a backstop above the controller's hang
    detection (see docs/timeouts.md); None: ``timeout_s``."""


def listen_socket(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` with a port chosen by the OS (for a store master).

    Binding ourselves keeps the store on ``host`` only (127.0.0.1 for a local job) instead
    of every interface.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    return sock


def host_store(host: str) -> dist.TCPStore:
    """Start a TCPStore master on ``host`` (the controller hosts it, never a worker).

    The store takes over the listening socket and closes it when it is destroyed.
    """
    sock = listen_socket(host)
    store = dist.TCPStore(
        host,
        sock.getsockname()[1],
        None,
        True,
        datetime.timedelta(seconds=60),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        use_libuv=True,
    )
    sock.detach()
    return store


_WAIT_SLICE = datetime.timedelta(milliseconds=100)
_SLICE_TIMEOUT = "Operation timed out"
"""What c10d's ``Work.wait(timeout)`` raises when the slice runs out (the work goes on)."""

# Backend process-group objects (ProcessGroupGloo / ProcessGroupNCCL): their Python stubs do
# not share a useful base type, so they are typed loosely.
_Group = Any


def _socket_inodes() -> dict[int, str]:
    """This process's open sockets: fd -> ``socket:[inode]`` (empty where /proc is missing)."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                out[int(fd)] = target
    return out


@contextlib.contextmanager
def _held_socket(fd: int, target: str) -> Iterator[socket.socket | None]:
    """The socket ``fd`` named when it was listed as ``target``, held by a duplicate; or None.

    Between listing /proc/self/fd and using an fd, another thread may close it and reuse
    the number for a new socket (a store client, the next generation's Gloo pair). The
    duplicate keeps whatever the fd names *now* open, and its inode says whether that is
    still the listed socket, so nothing else is ever touched.
    """
    sock: socket.socket | None = None
    with contextlib.suppress(OSError):
        dup = os.dup(fd)
        try:
            if f"socket:[{os.fstat(dup).st_ino}]" == target:
                sock = socket.socket(fileno=dup)
        finally:
            if sock is None:
                os.close(dup)
    if sock is None:
        yield None
        return
    with sock:
        yield sock


class _Transport:
    """The TCP connections of one worker's Gloo groups, so that `close` can cut them.

    See [Note: tearing down on failure]. The sockets are those that appeared while the
    groups formed (``before`` is the snapshot taken just ahead) *and* that belong to a Gloo
    pair: accepted on one of this worker's Gloo listeners, or connected to a peer's. Every
    worker publishes its listener ports in the generation's store, so a socket some other
    thread of the process opened meanwhile (Ray's) is never touched.
    """

    def __init__(
        self, before: dict[int, str], store: dist.Store, rank: int, peers: list[int]
    ) -> None:
        new = {fd: ino for fd, ino in _socket_inodes().items() if before.get(fd) != ino}
        listening: set[int] = set()
        connected: dict[int, tuple[str, int, int]] = {}  # fd -> (inode, local port, remote port)
        for fd, inode in new.items():
            with contextlib.suppress(OSError), _held_socket(fd, inode) as sock:
                if sock is None:
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    listening.add(sock.getsockname()[1])
                elif sock.type == socket.SOCK_STREAM:
                    connected[fd] = (inode, sock.getsockname()[1], sock.getpeername()[1])
        store.set(f"gloo_ports/{rank}", ",".join(str(p) for p in sorted(listening)))
        ports = set(listening)
        for peer in peers:
            text = store.get(f"gloo_ports/{peer}").decode()
            ports |= {int(p) for p in text.split(",") if p}
        self._sockets = {
            fd: inode
            for fd, (inode, local, remote) in connected.items()
            if local in listening or remote in ports
        }

    def shut_down(self) -> None:
        """Shut every Gloo connection down, waking all waiters here and at the peers."""
        for fd, inode in self._sockets.items():
            # Closed already, the fd may now name something else: only the listed socket.
            with contextlib.suppress(OSError), _held_socket(fd, inode) as sock:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
        self._sockets = {}


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
    or at Gloo's timeout), after which the thread serves the next."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Waitable, threading.Event, list[BaseException]]]
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="checkfree-p2p-wait", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, done, error = self._queue.get()
            try:
                work.wait()
            except BaseException as exc:  # handed to the caller
                error.append(exc)
            finally:
                done.set()
            del work, done, error

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


class StageComm:
    """One worker's process groups for one generation.

    Args:
        rendezvous: the controller's store address and this generation's key prefix.
        topology: the job layout; ``rank`` is this worker's global rank in it.
        backend: ``gloo`` or ``nccl``.
        bind_host: the address this worker's transport listens on (its node's IP).
        device: the compute device (`parallelism.devices.compute_device`); default the
            backend's own (`device_for`). Tensors given to and received from this object
            are on it; the backend moves them on ``wire`` (`parallelism.devices.wire_device`),
            staged in between when the two differ ([Note: compute device and wire device]).
        members: the global ranks of this generation's workers (default: all of the
            topology's). A shrunk job's generation leaves out the workers it runs without
            (see [Note: elastic shrink] in recovery/runtime/elastic.py); every group is formed
            over the members only, and callers keep using global ranks.
        cancel: set (from another thread) to give up forming the groups at once, with a
            communication error (see [Note: abandoning a formation]).

    Raises:
        RuntimeError: if the group cannot be formed within ``rendezvous.timeout_s``.
        ValueError: for NCCL with a compute device that is not CUDA.
    """

    def __init__(
        self,
        rendezvous: Rendezvous,
        topology: Topology,
        rank: int,
        backend: str,
        bind_host: str,
        *,
        side_group: bool = False,
        tied: tuple[int, ...] = (),
        device: torch.device | None = None,
        members: tuple[int, ...] | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.topology = topology
        self.rank = rank
        self.members = tuple(sorted(members)) if members is not None else None
        if self.members is not None and rank not in self.members:
            raise ValueError(f"rank {rank} is not a member of this generation {self.members}")
        present = self.members if self.members is not None else range(topology.world_size)
        self._index = {r: i for i, r in enumerate(present)}
        """Global rank -> its rank in this generation's world (the same without a shrink)."""
        self.worker = topology.worker(rank)
        self.backend = backend
        self.device = device if device is not None else device_for(backend)
        """The compute device: where what is sent comes from and what is received goes."""
        self.wire = wire_device(backend, self.device)
        """Where the backend moves bytes (host memory for Gloo, the GPU for NCCL)."""
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        base = dist.TCPStore(rendezvous.host, rendezvous.port, None, False, timeout)
        collective = datetime.timedelta(
            seconds=rendezvous.collective_s
            if rendezvous.collective_s is not None
            else rendezvous.timeout_s
        )
        self._store: dist.Store | None = dist.PrefixStore(rendezvous.prefix, base)
        # Connected: from now on, dropping the generation's store fails our waits at once
        # (the controller waits for this key before it drops a formation that cannot finish).
        self._store.set(f"joined/{rank}", "1")
        before = _socket_inodes()
        world_store = dist.PrefixStore("world", self._store)

        def form(
            backend: str, store: dist.Store, rank: int, size: int, device: torch.device | None
        ) -> _Group:
            return _make_group(
                backend,
                store,
                rank,
                size,
                bind_host,
                collective,
                device,
                formation=timeout,
                cancel=cancel,
            )

        self._world: _Group | None = form(
            backend, world_store, self._index[rank], len(self._index), self.wire
        )
        self._stage: _Group | None = None
        stage_peers = [r for r in topology.stage_group(self.worker.stage) if r in self._index]
        if len(stage_peers) > 1:
            stage_store = dist.PrefixStore(f"stage{self.worker.stage}", self._store)
            self._stage = form(
                backend, stage_store, stage_peers.index(rank), len(stage_peers), self.wire
            )
        # The workers that hold bit-identical replicas of some parameters (CheckFree+'s
        # (de)embedding on stages 0 and 1, or S-2 and S-1), every replica of both stages.
        self._tied: _Group | None = None
        if tied:
            tied_store = dist.PrefixStore("tied" + "_".join(map(str, tied)), self._store)
            self._tied = form(backend, tied_store, tied.index(rank), len(tied), self.wire)
        # A second, always-Gloo world group for traffic that runs beside the step on another
        # thread (peer snapshots in host memory): it never competes with the step's ordering.
        self._side: _Group | None = None
        if side_group:
            side_store = dist.PrefixStore("side", self._store)
            self._side = form("gloo", side_store, self._index[rank], len(self._index), None)
        self._transport = (
            _Transport(before, self._store, rank, list(self._index))
            if backend == "gloo" or side_group
            else None
        )
        self._mesh: Mesh | None = None
        self._waiter: _Waiter | None = None
        self._collective_timeout = collective
        self._pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        self._blocked_on: int | None = None
        # NCCL's waits are queued on the GPU: what they wait for is known from events
        # (parallelism/progress.py); Gloo's block the calling thread.
        self._queued: Progress = progress_for(self.wire) if backend == "nccl" else Progress()
        # The commit vote's own sockets, formed last: every peer is past its Gloo groups.
        try:
            self._mesh = Mesh(
                dist.PrefixStore("vote", self._store),
                self._index[rank],
                len(self._index),
                bind_host,
                timeout,
                cancel,
            )
        except BaseException:
            self.close()
            raise

    @property
    def waiting_on(self) -> int | None:
        """The peer rank this worker is waiting for (-1: a collective), else None: the one a
        blocking call waits for, or under NCCL the one of the oldest wait queued on the GPU
        that has not completed (the CPU blocks on it later, in ``.item()``)."""
        blocked = self._blocked_on
        return blocked if blocked is not None else self._queued.waiting_on()

    @property
    def store(self) -> dist.Store:
        """This generation's view of the controller's store."""
        if self._store is None:
            raise RuntimeError("process group used after close()")
        return self._store

    # -- point to point (global ranks) ---------------------------------------------------

    @property
    def world(self) -> _Group:
        if self._world is None:
            raise RuntimeError("process group used after close()")
        return self._world

    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to global rank ``dst`` without waiting; see `wait_sends`. A tensor
        off the wire device is sent from a wire copy (`to_wire`), finished before this
        returns, so the caller may change ``tensor`` at once."""
        tensor = to_wire(tensor, self.wire)
        self._pending.append((self.world.send([tensor], self._index[dst], 0), tensor, dst))

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``tensor`` from global rank ``src``, blocking (on the wire first
        when ``tensor`` is off the wire device, then copied into it)."""
        landing = tensor if tensor.device == self.wire else wire_buffer(tensor, self.wire)
        self.wait(self.world.recv([landing], self._index[src], 0), src)
        return land(tensor, landing)

    def recv_many(self, tensors: list[torch.Tensor], src: int) -> None:
        """Receive into each of ``tensors`` in order from ``src``, all receives posted at once."""
        landings = [t if t.device == self.wire else wire_buffer(t, self.wire) for t in tensors]
        works = [self.world.recv([t], self._index[src], 0) for t in landings]
        for work in works:
            self.wait(work, src)
        for tensor, landing in zip(tensors, landings, strict=True):
            land(tensor, landing)

    def _collective_on(self, tensor: torch.Tensor, start: Any) -> Waitable:
        """Start ``start([wire tensor])`` on ``tensor``, or on a wire copy of it that waiting
        copies back (`StagedWork`)."""
        if tensor.device == self.wire:
            return start([tensor])
        staged = to_wire(tensor, self.wire)
        return StagedWork(start([staged]), staged, tensor)

    def wait(self, work: Waitable, peer: int = -1) -> None:
        """Wait for ``work``, noting whom we wait for (see `waiting_on`).

        Raises:
            RuntimeError: the work's error, or a connection error if `close` ran meanwhile.
        """
        self._blocked_on = peer
        try:
            if self.backend == "gloo" and peer == -1:
                self._wait_collective(work)
            elif self.backend == "gloo":
                self._wait_point_to_point(work)
            else:
                work.wait()  # NCCL: enqueues a stream wait, the CPU does not block
                self._queued.queued_wait(peer)
        finally:
            self._blocked_on = None

    def _wait_point_to_point(self, work: Waitable) -> None:
        """Block on a Gloo send or receive until it completes or this worker's groups are
        closed: cutting the connections wakes it, except in the race of `_wait_collective`,
        which sends and receives meet too under load (a transfer a dead peer will never
        finish then waits for Gloo's timeout). Their wait cannot be sliced -- Gloo would
        fail the transfer itself when a slice ran out -- so one waits on a helper thread
        (`_Waiter`) while this one checks, in slices, whether the groups were closed."""
        if work.is_completed():
            work.wait()  # its result, or its error
            return
        if self._waiter is None:
            self._waiter = _Waiter()
        if not self._waiter.wait(work, lambda: self.closed):
            raise RuntimeError(
                "Connection closed: this worker's process groups were torn down while it "
                "waited on a peer"
            )

    def _wait_collective(self, work: Waitable) -> None:
        """Block on a Gloo collective until it completes or this worker's groups are closed.

        See [Note: tearing down on failure]: cutting the connections wakes a waiter, except
        in one race that the tests met under load (a collective queued on the group's
        worker thread while another thread closes the group; Gloo then leaves it pending
        until its own timeout, a minute). So a collective is waited on in short slices
        (re-waiting a Gloo collective after a slice runs out is safe) and given up as soon
        as the groups are closed. Not so a send or a receive: Gloo hands their timeout to
        the transfer itself, which then fails; they run on the calling thread and the cut
        connections always wake them.
        """
        while True:
            try:
                work.wait(_WAIT_SLICE)
                return
            except RuntimeError as exc:
                if _SLICE_TIMEOUT not in str(exc):
                    raise  # the work's own error (a dead peer, Gloo's timeout)
                if self.closed:
                    raise RuntimeError(
                        "Connection closed: this worker's process groups were torn down "
                        "while it waited"
                    ) from None

    def wait_sends(self) -> None:
        """Wait until every `isend` so far has completed (their buffers may then be reused)."""
        pending, self._pending = self._pending, []
        for work, _, dst in pending:
            self.wait(work, dst)

    def send_activation(self, value: Activation, dst: int) -> None:
        """Send an activation -- one tensor, or a tuple of tensors -- of any shapes and dtypes.

        Each tensor is preceded by a small metadata header (its shape, dtype, whether it
        requires a gradient, and how many tensors the tuple holds), so the receiver needs
        no prior knowledge: `recv_activation` reads the headers. Users never declare
        activation shapes. A tuple is what a stage split off a model by
        ``torch.distributed.pipelining`` passes on when several values cross the split
        (GPT-2 passes its hidden states and its attention mask).
        """
        tensors = value if isinstance(value, tuple) else (value,)
        if not 0 < len(tensors) <= _MAX_TUPLE:
            raise ValueError(f"an activation is 1 to {_MAX_TUPLE} tensors, got {len(tensors)}")
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(
                    f"a stage must return a tensor or a tuple of tensors, got "
                    f"{type(tensor).__name__}"
                )
            if tensor.dim() > _MAX_DIMS:
                raise ValueError(f"cannot send a tensor of {tensor.dim()} dims (max {_MAX_DIMS})")
            if tensor.dtype not in _DTYPES:
                raise ValueError(f"cannot send dtype {tensor.dtype}; supported: {_DTYPES}")
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            header[0] = tensor.dim()
            header[1] = _DTYPES.index(tensor.dtype)
            header[2] = len(tensors) if isinstance(value, tuple) else 0
            header[3] = int(tensor.requires_grad)
            header[4 : 4 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            self.isend(header.to(self.wire), dst)
            self.isend(tensor.detach(), dst)

    def recv_activation(self, src: int) -> Activation:
        """Receive an activation sent with `send_activation`.

        A received tensor requires a gradient exactly when the sent one did, so the
        backward pass sends gradients back for those and only those (`activation_grads`).
        """
        tensors: list[torch.Tensor] = []
        count = 1
        first_size: int | None = None
        while len(tensors) < count:
            header = self.recv(torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.wire), src)
            meta = header.tolist()
            ndim, code, size, grad = meta[:4]
            shape = meta[4 : 4 + ndim]
            # Checked before anything is allocated: after an abort the buffer holds garbage.
            # Every header of a tuple announces the same tuple size (the first one's).
            if not (
                0 <= ndim <= _MAX_DIMS
                and 0 <= code < len(_DTYPES)
                and 0 <= size <= _MAX_TUPLE
                and grad in (0, 1)
                and all(0 <= d <= _MAX_ELEMENTS for d in shape)
                and math.prod(shape) <= _MAX_ELEMENTS
                and (first_size is None or size == first_size)
            ):
                raise GarbledMessage(f"an activation header {meta} from rank {src}")
            first_size = size
            dtype = _DTYPES[code]
            buffer = empty_received(
                shape, dtype, self.device, f"an activation header from rank {src}"
            )
            tensor = self.recv(buffer, src)
            tensors.append(tensor.requires_grad_(bool(grad)))
            count = max(1, int(size))
        return tuple(tensors) if int(size) else tensors[0]

    # -- the side group (host memory, another thread) ----------------------------------

    def side_isend(self, tensors: list[torch.Tensor], dst: int) -> list[dist.Work]:
        """Start sending CPU ``tensors`` to ``dst`` over the side group; wait on the result."""
        if self._side is None:
            raise RuntimeError("no side group in this generation (closed, or not requested)")
        return [self._side.send([t.contiguous()], self._index[dst], 0) for t in tensors]

    def side_recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into CPU ``tensor`` from ``src`` over the side group, blocking."""
        if self._side is None:
            raise RuntimeError("no side group in this generation (closed, or not requested)")
        self._side.recv([tensor], self._index[src], 0).wait()
        return tensor

    def side_wait(self, works: list[dist.Work]) -> None:
        """Wait for `side_isend`'s works."""
        for work in works:
            work.wait()

    # -- collectives -----------------------------------------------------------------------

    def allreduce_stage(self, tensor: torch.Tensor) -> Waitable | None:
        """Start a sum all-reduce of ``tensor`` across this stage's replicas (None if alone).

        Raises:
            RuntimeError: if the groups were closed (never silently skip the reduction).
        """
        if self.closed:
            raise RuntimeError("process group used after close()")
        if self._stage is None:
            return None
        return self._collective_on(tensor, self._stage.allreduce)

    def broadcast_stage(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrite ``tensor`` with replica ``root``'s, across this stage's replicas; blocks.

        Raises:
            RuntimeError: if the groups were closed, or a peer died.
        """
        if self.closed:
            raise RuntimeError("process group used after close()")
        if self._stage is None:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        stage = self._stage
        self.wait(self._collective_on(tensor, lambda ts: stage.broadcast(ts, opts)))

    def allreduce_tied(self, tensor: torch.Tensor) -> Waitable:
        """Start a sum all-reduce of ``tensor`` over the holders of this worker's tied parameters.

        Raises:
            RuntimeError: if the groups were closed or this worker holds no tied parameters.
        """
        if self.closed or self._tied is None:
            raise RuntimeError("no tied group in this generation (closed, or nothing shared)")
        return self._collective_on(tensor, self._tied.allreduce)

    def barrier(self) -> None:
        """Block until every worker of the generation reaches this point."""
        self.wait(self.world.allreduce([torch.zeros(1, device=self.wire)]))

    def exchange(self, row: Sequence[float]) -> dict[int, tuple[float, ...]]:
        """Every worker's ``row`` (all of one length, float64 on the wire), by global rank;
        blocks. On the calling thread, over the generation's own TCP connections, not a
        process group: see [Note: the vote's own connections] in parallelism/mesh.py.

        Raises:
            RuntimeError: if the groups were closed.
            ConnectionError: a peer died, or the groups were closed meanwhile.
        """
        mesh = self._mesh
        if mesh is None:
            raise RuntimeError("process group used after close()")
        self._blocked_on = -1
        try:
            rows = mesh.allgather(row, self._collective_timeout)
        finally:
            self._blocked_on = None
        return {r: rows[i] for r, i in self._index.items()}

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Tear the groups down so that peers blocked on this worker fail fast.

        See [Note: tearing down on failure]. Safe to call more than once.
        """
        # A worker's step thread and its control thread may both close: take each part
        # once read, so the other's None never lands between a check and a use.
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.shut_down()
        mesh, self._mesh = self._mesh, None
        if mesh is not None:
            mesh.shut_down()
        groups = [g for g in (self._world, self._stage, self._tied, self._side) if g is not None]
        self._pending = []
        self._world = None
        self._stage = None
        self._tied = None
        self._side = None
        self._store = None
        abort_groups(groups)
        _REAPER.bury(groups)  # see [Note: process groups die on a thread of their own]

    @property
    def closed(self) -> bool:
        return self._world is None
