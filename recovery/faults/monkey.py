"""Failing a job from outside the library: SIGKILLs of its worker processes at wall-clock
times the controller knows nothing about (scripts/chaos.py, tests/test_outside_kills.py).

`kill_schedule` is pure: seeded Poisson arrivals with a given mean gap, each followed with
probability ``burst_prob`` by a second kill a fraction of a second later, so that it lands
inside the recovery the first one started. `ChaosMonkey` is the thread that follows a
schedule against a running job (anything with `live_workers()`, e.g. a `Trainer` in
`fit`); `kill_process` is the one SIGKILL, and says whether it landed. What a job that
lived through it must end with is `recovery.reference.differences`'s business (the oracle).
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from recovery.faults.exits import expect_exit

__all__ = [
    "ChaosMonkey",
    "KillRecord",
    "PlannedKill",
    "kill_process",
    "kill_schedule",
    "process_gone",
]

Coords = tuple[int, int]


@dataclass(frozen=True)
class PlannedKill:
    """One kill of a schedule."""

    at_s: float
    """Seconds after the job started training."""
    pick: float
    """In [0, 1): which live worker, counting in (stage, replica) order."""
    burst: bool
    """A burst kill: it follows the kill before it by a burst gap."""

    def victim(self, candidates: list[Coords]) -> Coords:
        """The worker this kill picks from ``candidates`` (sorted)."""
        return candidates[min(int(self.pick * len(candidates)), len(candidates) - 1)]


def kill_schedule(
    *,
    seed: int,
    mean_interval_s: float,
    burst_prob: float = 0.0,
    burst_gap_s: tuple[float, float] = (0.05, 0.5),
) -> Iterator[PlannedKill]:
    """An endless, reproducible schedule of kills: the gap from one kill (or from its burst)
    to the next is exponential with mean ``mean_interval_s``; after each such kill, with
    probability ``burst_prob``, a burst kill follows after a gap uniform in ``burst_gap_s``.

    Raises:
        ValueError: for a mean interval that is not a positive finite number, a burst
            probability outside [0, 1], or a burst gap that is not ``0 <= lo <= hi``.
    """
    if not (isinstance(mean_interval_s, int | float) and 0 < mean_interval_s < math.inf):
        raise ValueError(f"mean_interval_s must be a positive number, got {mean_interval_s!r}")
    if not (isinstance(burst_prob, int | float) and 0.0 <= burst_prob <= 1.0):
        raise ValueError(f"burst_prob must be in [0, 1], got {burst_prob!r}")
    lo, hi = burst_gap_s
    if not 0.0 <= lo <= hi < math.inf:
        raise ValueError(f"burst_gap_s must be (lo, hi) with 0 <= lo <= hi, got {burst_gap_s!r}")
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mean_interval_s)
        yield PlannedKill(at_s=t, pick=rng.random(), burst=False)
        if rng.random() < burst_prob:
            t += rng.uniform(lo, hi)
            yield PlannedKill(at_s=t, pick=rng.random(), burst=True)


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited: no such process, or a zombie its parent has not reaped
    yet (a killed Ray worker can stay one for a while; signals to it still succeed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def kill_process(pid: int) -> bool:
    """SIGKILL ``pid``; True if it landed, False if the process was already gone
    (`process_gone`)."""
    if process_gone(pid):
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


@dataclass(frozen=True)
class KillRecord:
    """What one planned kill did."""

    at_s: float
    """Seconds after the job started training, when it was carried out."""
    burst: bool
    worker: Coords | None
    """The victim; None if no live worker could be picked."""
    pid: int | None
    landed: bool
    """The process was alive and got the SIGKILL."""
    wiped: tuple[int, ...] = ()
    """The stages that, with this kill, had no worker holding their state left (every
    replica dead or still being rebuilt): from then on only a snapshot can bring them back."""

    def __str__(self) -> str:
        kind = "burst kill" if self.burst else "kill"
        if self.worker is None:
            return f"{self.at_s:7.2f} s  {kind}: no live worker to kill"
        s, r = self.worker
        outcome = "landed" if self.landed else "missed (already gone)"
        wiped = f"; stage(s) {list(self.wiped)} now hold no live replica" if self.wiped else ""
        return f"{self.at_s:7.2f} s  {kind} of ({s},{r}) pid {self.pid}: {outcome}{wiped}"


class _Process(Protocol):
    """What the monkey reads of a worker (`recovery.worker.WorkerInfo`): its process."""

    @property
    def pid(self) -> int: ...


class _Job(Protocol):
    def live_workers(self) -> Mapping[Coords, _Process]: ...


def _holders(job: _Job) -> Mapping[Coords, _Process]:
    """The workers that hold their stage's state now (`Trainer.holders`; a job that cannot
    tell: every live worker)."""
    holders = getattr(job, "holders", None)
    return holders() if holders is not None else job.live_workers()


@dataclass
class ChaosMonkey:
    """A thread that follows ``schedule`` against ``job`` while it trains.

    The schedule's clock starts when ``job.live_workers()`` first lists workers (the job
    is training); the monkey stops once the list is empty again (the last step has
    committed), after ``max_kills`` landed kills, or on `stop`. A victim is picked among
    the listed workers whose process it has not already killed. Each kill records the
    stages it left with no live worker holding their state (``job.holders()``, if the job
    tells), so that a job's death can be judged: lost while a replica of every stage
    lived, or not. With ``keep_a_replica`` the monkey never kills the last such worker of
    a stage: every job must then survive.
    """

    job: _Job
    schedule: Iterable[PlannedKill]
    max_kills: int | None = None
    on_kill: Callable[[KillRecord], None] = lambda record: None
    start_timeout_s: float = 600.0
    """How long to wait for the job to start training."""
    keep_a_replica: bool = False
    """Spare the last live worker that holds a stage's state."""
    records: list[KillRecord] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def landed(self) -> int:
        return sum(r.landed for r in self.records)

    def _run(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self.job.live_workers():
            if self._stop.wait(0.01) or time.monotonic() > deadline:
                return
        t0 = time.monotonic()
        killed: set[int] = set()
        for planned in self.schedule:
            if self.max_kills is not None and self.landed >= self.max_kills:
                return
            if self._stop.wait(max(0.0, t0 + planned.at_s - time.monotonic())):
                return
            workers = self.job.live_workers()
            if not workers:
                return
            holding = {c: i.pid for c, i in _holders(self.job).items() if i.pid not in killed}
            candidates = sorted(c for c, info in workers.items() if info.pid not in killed)
            if self.keep_a_replica:
                candidates = [c for c in candidates if not _last(c, workers[c].pid, holding)]
            if not candidates:
                record = KillRecord(time.monotonic() - t0, planned.burst, None, None, False)
            else:
                victim = planned.victim(candidates)
                pid = workers[victim].pid
                # Only the log hears of it (Ray's paragraph on an unexpected death becomes
                # one line); the controller finds the death as it would any other.
                expect_exit(pid, "killed by the chaos monkey")
                landed = kill_process(pid)
                killed.add(pid)
                left = {c[0] for c, p in holding.items() if p not in killed}
                wiped = tuple(sorted({c[0] for c in holding} - left))
                record = KillRecord(
                    time.monotonic() - t0, planned.burst, victim, pid, landed, wiped
                )
            self.records.append(record)
            self.on_kill(record)

    @property
    def wiped(self) -> list[int]:
        """Every stage some kill left with no live worker holding its state."""
        return sorted({s for r in self.records for s in r.wiped})


def _last(victim: Coords, pid: int, holding: Mapping[Coords, int]) -> bool:
    """Whether ``victim`` is the only worker left holding its stage's state."""
    mates = [c for c, p in holding.items() if c[0] == victim[0]]
    return mates == [victim] and holding[victim] == pid
