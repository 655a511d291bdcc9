"""Straggler detection: a worker persistently slower than the other replicas of its stage.

A pure class over per-step compute times (`StragglerDetector`), tested without a runtime
(tests/test_stragglers.py); the step runner feeds it every committed step's reports and the
controller turns what it finds into a failure (`straggler_failure`), recovered from by
the same machinery as a death.

[Note: stragglers]
What is compared: each worker's compute time in the step -- its forward and backward
passes (`StepStats.compute_s`, parallelism/engine.py), not the waits on its peers. A slow
worker makes its peers wait too, so their wall time grows with its own; their compute
does not. A worker stopped and continued from outside (SIGSTOP/SIGCONT in a duty cycle)
loses the stopped time wherever it was stopped: inside a forward or backward pass that
time is its compute. Each worker is compared with the median of the *other* replicas of
its stage in the same step (with two replicas, the other one: a median that included the
worker itself would halve its ratio). The replicas of a stage run the same layers on
batches of the same shape, so their times agree within noise; a whole machine that slows
down (a CPU hog, thermal throttling) slows every replica together and leaves the ratio
near 1.

The rule (`StragglerPolicy`), over a window of the last ``patience`` steps: a worker is a
straggler when its compute over the window exceeds ``factor`` times the others' (their
median in each step, summed) and by at least ``min_gap_s`` a step, *and* it was slow --
above ``factor`` times the others' median -- in at least ``quorum`` of the window's steps.
The first says it is persistently slower on average; the second that a few outliers did
not make the average: one step 100x slower would lift a 20-step sum above 2x, but it is
one slow step of 20. Not every step of the window need be slow: a worker throttled in a
duty cycle is slow in most steps, not all (some steps' computation falls between two
stops), and a run of slow steps broken by one fast one is no less a straggler. No worker
is judged before its window is full: in the first ``patience`` steps of a job, or after a
recovery (everything starts afresh there: the replacements' first steps warm up).

What it cannot see: a stage with a single replica (nothing to compare with: never
judged), a job that shrank (the complete pipelines compute the missing one's share: not
judged until it grows back), and on a GPU, compute time is what the host measured around
the launches unless the step synchronizes (the last stage does, reading its loss).
At most one fewer than all replicas of a stage is ever found: the fastest one cannot be
``factor`` times slower than the others.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from parallelism.topology import Topology
from recovery.names import FailureCause
from recovery.policy import StragglerPolicy
from recovery.runtime.records import Failure
from recovery.worker import StepReport

__all__ = [
    "Straggler",
    "StragglerDetector",
    "StragglerWatch",
    "medians_of_others",
    "straggler_failure",
]


@dataclass(frozen=True)
class Straggler:
    """A worker found slower than the other replicas of its stage."""

    rank: int
    ratio: float
    """Its compute time over the window divided by the median of the other replicas'."""
    slow_steps: int
    """How many steps of the window were slow."""
    window: int
    """The window's length (``patience``)."""
    step: int
    """The last step of the window: when it was found."""

    def describe(self) -> str:
        return (
            f"straggler: compute {self.ratio:.2f}x the median of its stage's other replicas, "
            f"slow in {self.slow_steps} of the last {self.window} steps (to step {self.step})"
        )


@dataclass(frozen=True)
class _Seen:
    slow: bool
    own: float
    others: float
    """The median of the other replicas' compute in the same step."""


class StragglerDetector:
    """Per-worker compute times, step by step, judged by ``config``'s rule (see [Note:
    stragglers])."""

    def __init__(self, topology: Topology, config: StragglerPolicy) -> None:
        self.topology = topology
        self.config = config
        self._seen: dict[int, collections.deque[_Seen]] = {}
        self._last_step = -1

    @property
    def judges(self) -> bool:
        """Whether anyone can be found at all: two or more replicas per stage."""
        return self.topology.replicas >= 2

    def observe(self, step: int, compute: Mapping[int, float]) -> None:
        """Add one committed step: each reporting rank's compute seconds. A rank that did
        not report (a stage group with fewer than two reports) adds nothing."""
        cfg = self.config
        self._last_step = step
        for stage in range(self.topology.stages):
            group = [r for r in self.topology.stage_group(stage) if r in compute]
            if len(group) < 2:
                continue
            times = [compute[r] for r in group]
            for rank, own, others in zip(group, times, medians_of_others(times), strict=True):
                slow = own > cfg.factor * others
                seen = self._seen.setdefault(rank, collections.deque(maxlen=cfg.patience))
                seen.append(_Seen(slow, own, others))

    def found(self) -> list[Straggler]:
        """The stragglers now, slowest first within each stage; never every replica of a
        stage (the fastest is kept, whatever its record)."""
        cfg = self.config
        need = math.ceil(cfg.quorum * cfg.patience)
        out: list[Straggler] = []
        for stage in range(self.topology.stages):
            group = self.topology.stage_group(stage)
            stragglers = []
            for rank in group:
                seen = self._seen.get(rank)
                if seen is None or len(seen) < cfg.patience:
                    continue
                slow = sum(s.slow for s in seen)
                own, others = sum(s.own for s in seen), sum(s.others for s in seen)
                ratio = own / others if others > 0 else math.inf
                gap = (own - others) / cfg.patience
                if slow >= need and ratio > cfg.factor and gap > cfg.min_gap_s:
                    stragglers.append(Straggler(rank, ratio, slow, cfg.patience, self._last_step))
            stragglers.sort(key=lambda s: -s.ratio)
            out.extend(stragglers[: len(group) - 1])
        return out

    def reset(self, ranks: Collection[int] | None = None) -> None:
        """Forget ``ranks``' record (default: everyone's): after a recovery, or while the job
        is shrunk."""
        if ranks is None:
            self._seen.clear()
        else:
            for rank in ranks:
                self._seen.pop(rank, None)


def medians_of_others(values: Sequence[float]) -> list[float]:
    """For each value, `statistics.median` of all the others -- from one sort, not one per
    value (a stage group of hundreds of replicas, every step, on the driver)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranked = [values[i] for i in order]
    half, odd = divmod(len(values) - 1, 2)
    out = [0.0] * len(values)
    for pos, index in enumerate(order):

        def at(k: int, pos: int = pos) -> float:  # the k-th of the others, in order
            return ranked[k if k < pos else k + 1]

        out[index] = at(half) if odd else (at(half - 1) + at(half)) / 2
    return out


class StragglerWatch:
    """The step runner's side: every committed step's reports fed to a detector -- or to
    none, when the policy's ``stragglers`` is off or each stage has one replica."""

    def __init__(self, topology: Topology, config: StragglerPolicy | None) -> None:
        detector = StragglerDetector(topology, config) if config is not None else None
        self.detector = detector if detector is not None and detector.judges else None
        self.found: list[Straggler] = []
        """What the detector found after the last step noted."""

    def note(self, step: int, reports: Mapping[int, StepReport], *, shrunk: bool) -> None:
        """A committed step (not judged while the job is ``shrunk``: the complete pipelines
        compute the missing one's share then)."""
        if self.detector is None:
            return
        if shrunk:
            self.reset()
            return
        self.detector.observe(step, {r: rep.stats.compute_s for r, rep in reports.items()})
        self.found = self.detector.found()

    def reset(self) -> None:
        if self.detector is not None:
            self.detector.reset()
        self.found = []


def straggler_failure(
    topology: Topology, found: Collection[Straggler], *, step: int, generation: int
) -> Failure:
    """The failure the controller recovers from for ``found``: each straggler is lost (its
    worker killed and rebuilt, or left out by an elastic job), cause ``straggler``, its
    ratio in the record."""
    now = time.time()
    return Failure(
        step=step,
        lost={s.rank for s in found},
        cause=FailureCause.STRAGGLER,
        detected_at=now,
        struck_at=now,
        errors={s.rank: s.describe() for s in found},
        generation=generation,
        slow={s.rank: s.ratio for s in found},
    )
