"""`WorkerGroup`: the job's worker processes, as the controller sees them.

The controller never touches Ray (or threads) directly: it starts, replaces and kills
workers, and calls their methods, through this interface. `RayWorkerGroup` runs each
worker as a Ray actor (production); `ThreadWorkerGroup` runs each as a thread of this
process (tests: the controller's transitions in milliseconds, no Ray). Both pass the same
conformance test (tests/test_worker_group.py).

[Note: calls and failures]
Every call is asynchronous: `submit` returns a `Call` handle at once, `wait` blocks on a
set of them with a deadline, and `result` reads one. A worker that died, or did not answer
in time, gives a `WorkerLost` -- the one failure the runtime recovers from. An exception
raised by user code inside a worker (a bug in the model, a bad batch) is re-raised as
itself by `result`: recovery cannot fix a bug, so it stops the job. `gather` and `call`
are the common case built on the three: results, losses and *broken* calls apart -- a
call whose worker is alive but raised a communication error (a peer died under it, see
`recovery.worker.is_comm_error`): its process groups are unusable, its state is not.
`require` turns losses and broken calls into `RecoveryInterrupted`. Control
methods (``probe``, ``abort``) run on a separate thread of the worker, so they are
answered while the worker is busy in, or stuck in, a step.
"""

from __future__ import annotations

import abc
import functools
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec

from recovery.errors import RecoveryInterrupted
from recovery.worker import WorkerInfo, is_comm_error

__all__ = [
    "CONTROL_METHODS",
    "Call",
    "CallResults",
    "Warmup",
    "WorkerGroup",
    "WorkerLost",
    "WorkerMethod",
    "require",
    "seconds",
]

P = ParamSpec("P")
WorkerMethod = Callable[Concatenate[Any, P], Any]
"""A method of the group's worker class, as the class spells it (``StageWorker.commit``):
calls name what they run by the method itself, never by a string, so a renamed or
misspelt method fails at import and in the type check, not on a worker."""
Warmup = Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]
"""``warm() -> (method, args)``: a spare's warm-up call (`WorkerGroup.add_spares`)."""

CONTROL_METHODS = frozenset({"probe", "abort"})
"""Methods answered on a worker's control thread (see [Note: calls and failures])."""


def seconds(timeout: timedelta | float) -> float:
    """A timeout as seconds: every wait in the runtime takes a `timedelta` or seconds."""
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class WorkerLost(Exception):
    """A worker died, or did not answer a call in time (see [Note: calls and failures])."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank}: {reason}")
        self.rank = rank
        self.reason = reason


@dataclass(frozen=True, eq=False)
class Call:
    """A submitted call: which worker, which method, and the implementation's handle."""

    rank: int
    method: str
    handle: Any = field(repr=False)


@dataclass
class CallResults:
    """What a call on several workers gave: results, and the workers lost meanwhile."""

    results: dict[Any, Any] = field(default_factory=dict)
    lost: dict[Any, WorkerLost] = field(default_factory=dict)
    broken: dict[Any, tuple[int, str]] = field(default_factory=dict)
    """Calls whose (live) worker raised a communication error: key -> (rank, error)."""
    unplaced: dict[Any, str] = field(default_factory=dict)
    """`WorkerGroup.start` only: ranks whose worker found no room on its node within the
    placement timeout (killed meanwhile) -> why."""

    @property
    def ok(self) -> bool:
        return not self.lost and not self.broken and not self.unplaced

    def as_lost(self) -> dict[Any, WorkerLost]:
        """The lost calls and the broken ones, all as losses (to rebuild them all)."""
        broken = {k: WorkerLost(rank, f"broke: {text}") for k, (rank, text) in self.broken.items()}
        return {**self.lost, **broken}

    def describe(self, what: str) -> str:
        """``could not <what>: rank 3: ...; rank 5: ...``."""
        errors = [str(e) for _, e in sorted(self.lost.items(), key=lambda kv: str(kv[0]))]
        errors += [f"rank {rank}: {text}" for rank, text in self.broken.values()]
        return f"could not {what}: {'; '.join(errors)}"


def require(got: CallResults, what: str) -> CallResults:
    """``got`` if every call succeeded.

    Raises:
        RecoveryInterrupted: naming ``what`` and the ranks lost or broken meanwhile.
    """
    if got.ok:
        return got
    raise RecoveryInterrupted(
        got.describe(what),
        lost={e.rank for e in got.lost.values()},
        broken={rank for rank, _ in got.broken.values()},
    )


class WorkerGroup(abc.ABC):
    """The job's workers, one per rank, each on a node. See [Note: calls and failures].

    A rank has at most one live worker; starting a rank that has one replaces it (the old
    worker is killed). Hot spares are workers warmed up ahead of need (torch imported,
    stage modules built once); `start` takes one on the right node when it can.
    """

    # -- membership --------------------------------------------------------------------

    @functools.cached_property
    def job(self) -> str:
        """A token naming this job (this group's life). Its formations and aborts carry it,
        so a worker parked and reused by a later job ignores an abort of this job's that was
        still on its way (see `StageWorker.abort`)."""
        return secrets.token_hex(8)

    @abc.abstractmethod
    def nodes(self) -> list[str]:
        """The nodes that are alive now (ids as the implementation names them)."""

    def store_host(self) -> str:
        """The address the controller's store listens on, so that every worker reaches it."""
        return "127.0.0.1"

    def check_capacity(self, workers: int) -> None:
        """Refuse a job whose ``workers`` processes the cluster can never hold at once
        (before any starts). The default: any number fits.

        Raises:
            ValueError: naming what is needed and what the cluster has.
        """
        del workers

    @abc.abstractmethod
    def start(
        self,
        placement: Mapping[int, str],
        *,
        timeout: timedelta | float,
        place_timeout: timedelta | float | None = None,
        spares: bool = False,
        parked: bool = False,
    ) -> tuple[CallResults, set[int]]:
        """Start a worker for each rank on its node and wait until each answers.

        ``timeout`` bounds a start that is under way (a process importing torch);
        ``place_timeout`` bounds the wait for room on the node, after which the rank is
        given up and lands in ``CallResults.unplaced`` with the reason (None: no bound but
        ``timeout``; an implementation that places at once ignores it).
        ``spares``: take a hot spare where there is one (on the rank's node first).
        ``parked``: reuse a warm worker an earlier job in this process left on that node.
        Returns each started worker's `WorkerInfo` (or why it did not start) and the ranks
        that got a warm worker. An implementation without parking ignores ``parked``.
        """

    @abc.abstractmethod
    def kill(self, ranks: Iterable[int]) -> None:
        """Kill these ranks' workers now, without waiting (unknown or dead ranks are ignored)."""

    @abc.abstractmethod
    def info(self, rank: int) -> WorkerInfo:
        """Where ``rank``'s worker runs. Raises KeyError for a rank with no worker."""

    @abc.abstractmethod
    def ranks(self) -> list[int]:
        """The ranks that have a worker (alive as far as the group knows)."""

    # -- spares ------------------------------------------------------------------------

    @abc.abstractmethod
    def add_spares(self, nodes: Sequence[str], warm: Warmup) -> None:
        """Start one hot spare on each of ``nodes`` and warm it up, without waiting.

        ``warm() -> (method, args)`` is the warm-up call to make on each. A node ``""``:
        wherever there is room, now or when some node has room later (its node is known
        once it is ready, see `ready_spare_nodes`).
        """

    @abc.abstractmethod
    def await_spares(
        self, timeout: timedelta | float, place_timeout: timedelta | float | None = None
    ) -> int:
        """Wait for the spares warming up; drop (and kill) those that failed, or found no
        room on their node within ``place_timeout``. Returns the number of spares ready."""

    @abc.abstractmethod
    def spare_count(self) -> int:
        """Hot spares held (ready or warming up)."""

    @abc.abstractmethod
    def spare_nodes(self) -> list[str]:
        """The node of each hot spare held, as far as the group knows it is alive. `start`
        with ``spares=True`` takes a spare only on the node it is asked for."""

    @abc.abstractmethod
    def ready_spare_nodes(self) -> list[str]:
        """The node of each hot spare whose warm-up has finished (without waiting); a
        spare whose warm-up failed is dropped."""

    # -- calls -------------------------------------------------------------------------

    def submit(self, rank: int, method: WorkerMethod[P], *args: P.args, **kwargs: P.kwargs) -> Call:
        """Call ``method(*args, **kwargs)`` on ``rank``'s worker; returns at once."""
        return self._send(rank, method.__name__, args, kwargs)

    @abc.abstractmethod
    def _send(self, rank: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        """`submit` as the implementation carries it out: the method by its name."""

    @abc.abstractmethod
    def wait(
        self, calls: Sequence[Call], timeout: timedelta | float, *, first: bool = False
    ) -> tuple[list[Call], list[Call]]:
        """Block until every call (``first``: at least one) has finished, or the timeout.

        Returns ``(finished, pending)``, each in the order given.
        """

    @abc.abstractmethod
    def result(self, call: Call) -> Any:
        """A finished call's result.

        Raises:
            WorkerLost: the worker died (or the call has not finished: it timed out).
            Exception: whatever the worker's own code raised, as itself.
        """

    @abc.abstractmethod
    def shutdown(self, *, clean: bool) -> None:
        """Drop every worker and spare; ``clean`` (the job finished) lets an implementation
        park reset workers for reuse by a later job in this process."""

    # -- built on the above ------------------------------------------------------------

    def gather(self, calls: Mapping[Any, Call], timeout: timedelta | float) -> CallResults:
        """Wait for ``calls`` (keyed as the caller likes) and read them all.

        Raises:
            Exception: the original error of a worker whose own code raised (other than a
                communication error, which lands in ``broken``).
        """
        self.wait(list(calls.values()), timeout)
        out = CallResults()
        for key, call in calls.items():
            try:
                out.results[key] = self.result(call)
            except WorkerLost as exc:
                out.lost[key] = exc
            except Exception as exc:
                if not is_comm_error(exc):
                    raise
                lines = str(exc).strip().splitlines()
                # A Ray task error's first line names the call; its last one, the cause.
                cause = f" ... {lines[-1][:300]}" if len(lines) > 1 else ""
                out.broken[key] = (
                    call.rank,
                    f"{type(exc).__name__}: {lines[0][:300] if lines else ''}{cause}",
                )
        return out

    def call(
        self,
        method: WorkerMethod[...],
        ranks: Iterable[int] | None = None,
        args: Callable[[int], Sequence[Any]] | None = None,
        *,
        timeout: timedelta | float,
    ) -> CallResults:
        """Call ``method`` on ``ranks`` (default: every worker) and wait for them all.

        ``args(rank)`` gives each worker's arguments. Returns results and lost workers.

        Raises:
            Exception: the original error of a worker whose own code raised.
        """
        targets = self.ranks() if ranks is None else list(ranks)
        calls = {
            r: self._send(r, method.__name__, tuple(args(r)) if args else (), {}) for r in targets
        }
        return self.gather(calls, timeout)
