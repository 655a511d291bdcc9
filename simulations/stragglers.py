"""Slow workers (stragglers) in the cluster simulator: when they come, how long they stay,
and what they cost with and without mitigation.

[Note: straggler model]

A *straggler* is a worker that computes ``factor`` times slower than its replicas (a
throttled GPU, a slow NIC, a noisy neighbour). Onsets form a Poisson process of
``rate_per_gpu_hour`` per GPU; each onset picks a GPU uniformly, and that GPU's worker
(its ``tp`` GPUs) is slow. It stays slow for an exponential time of mean ``mean_hours``
(``inf``: until it is handled), then recovers by itself.

A synchronous job runs at the pace of its slowest worker: while at least one straggler
is slow the job does ``1 / factor`` seconds of work per wall-clock second (every
straggler has the same factor, so two at once are no worse than one). The cluster
simulator turns wall time into work through a :class:`WorkClock`; time the job is
stalled by a recovery counts for nothing either way.

- *Unmitigated*: each straggler slows the job for its whole duration ``D``: it costs
  ``D * (1 - 1 / factor)`` of work, e.g. ``2T/3`` for a 3x straggler of ``T`` seconds.
- *Mitigated* (the runtime's ``RecoveryPolicy(stragglers=...)``): the straggler is
  detected after ``patience_steps`` steps at its slow pace (``patience * step_s *
  factor`` seconds of wall time) and its worker is then killed and replaced like a
  failed one: a failure event of that worker at that instant, which each strategy
  recovers as it recovers any failure (a replica copy from a warm spare for the peer
  strategies, a whole-job restart for ``checkpoint_restart``; the strategy's
  ``detect_s`` is charged again, which is conservative). A straggler that recovers
  before it is detected costs what it costs unmitigated. Per straggler the cost is
  ``patience * step_s * (factor - 1)`` of work plus the replacement.

Simplifications: the patience is counted in wall time from the onset (a recovery stall
during it does not delay detection); a failure of the slow worker does not end its
slowness; the runtime's detection threshold is taken to be below ``factor`` (a slower
worker is always detected); every replacement comes from the strategy's spare pool (no
elastic shrink: the simulator keeps the job's size); snapshot writes run at the slow pace
too.

Rates. No study found publishes a per-GPU straggler onset rate; the defaults below are
assumptions, each checked against what is published:

- Falcon / Greyhound (Wu et al., arXiv 2410.12588, USENIX ATC'25; a production cluster
  of over 10,000 GPUs): fail-slows last "from tens of seconds to nearly ten hours"
  (sub-minutes in the ATC version) and delay the average large job by 1.34x.
- ByteDance (Lin et al., "Understanding Stragglers in Large Model Training Using What-if
  Analysis", OSDI'25, arXiv 2505.05713): stragglers are frequent and not always caused by
  hardware failures (a five-month trace); no per-GPU rate in its abstract.

The default rate is Llama 3's per-GPU interruption rate (one per ~50,676 GPU-hours,
``simulations.traces.LLAMA3_GPU_MTBF_HOURS``): as many slow episodes as failures, an
assumption. With the default 1 h mean duration and 3x factor, a 16,384-GPU job has
0.32 onsets an hour, spends ~28% of its time with a straggler and runs ~1.23x longer
unmitigated (``1 / (1 - 0.28 * 2/3)``): the order of Falcon's 1.34x. The factor 3 is the issue's acceptance case, an assumption.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parallelism.checks import check_index, check_number, check_positive_int
from simulations.layout import Job
from simulations.traces import COMPONENTS, LLAMA3_GPU_MTBF_HOURS, FailureEvents

__all__ = [
    "STRAGGLER_FACTOR",
    "STRAGGLER_MEAN_HOURS",
    "STRAGGLER_PATIENCE_STEPS",
    "STRAGGLER_RATE_PER_GPU_HOUR",
    "StragglerDraws",
    "StragglerModel",
    "WorkClock",
]

STRAGGLER_RATE_PER_GPU_HOUR = 1.0 / LLAMA3_GPU_MTBF_HOURS
"""Straggler onsets per GPU-hour, ~1.97e-5: Llama 3's per-GPU interruption rate reused
(an assumption; see ``[Note: straggler model]``)."""
STRAGGLER_FACTOR = 3.0
"""How many times slower a straggler runs: the issue's 3x acceptance case (an
assumption)."""
STRAGGLER_MEAN_HOURS = 1.0
"""Mean duration of a slow episode, hours: an assumption inside Falcon's published range
of tens of seconds to nearly ten hours."""
STRAGGLER_PATIENCE_STEPS = 20
"""Steps a worker must stay slow before the runtime acts: an assumption (long enough
that one noisy step is no alarm)."""

_STREAM = 0x5106  # straggler draws' own random stream: failures stay common random numbers
_GPU = COMPONENTS.index("gpu")


@dataclass(frozen=True, kw_only=True)
class StragglerModel:
    """Where slow workers come from and how long they stay (``[Note: straggler model]``).

    Raises:
        ValueError: naming a bad rate, factor, duration or patience.
    """

    rate_per_gpu_hour: float = STRAGGLER_RATE_PER_GPU_HOUR
    """Onsets per GPU-hour (0: no stragglers)."""
    factor: float = STRAGGLER_FACTOR
    """A straggler's step time over its replicas' (>= 1)."""
    mean_hours: float = STRAGGLER_MEAN_HOURS
    """Mean of the exponential duration of a slow episode (``inf``: slow until handled)."""
    patience_steps: int = STRAGGLER_PATIENCE_STEPS
    """Steps at the slow pace before mitigation replaces the worker."""

    def __post_init__(self) -> None:
        check_number("StragglerModel.rate_per_gpu_hour", self.rate_per_gpu_hour, minimum=0.0)
        if not self.factor >= 1 or not math.isfinite(self.factor):
            raise ValueError(f"StragglerModel.factor must be >= 1 and finite, got {self.factor!r}")
        if not self.mean_hours > 0:
            raise ValueError(f"StragglerModel.mean_hours must be > 0, got {self.mean_hours!r}")
        check_positive_int("StragglerModel.patience_steps", self.patience_steps)

    @property
    def active(self) -> bool:
        """Whether this model slows anything at all."""
        return self.rate_per_gpu_hour > 0 and self.factor > 1

    def describe(self) -> str:
        """One line for tables."""
        lasting = (
            "slow until handled"
            if math.isinf(self.mean_hours)
            else f"mean {self.mean_hours:g} h (exponential)"
        )
        return (
            f"stragglers {self.rate_per_gpu_hour:.3g} per GPU-hour, {self.factor:g}x slower, "
            f"{lasting}, mitigated after {self.patience_steps} slow steps"
        )

    def sample(
        self, job: Job, horizon_s: float, *, seeds: int = 1, seed: int = 0, first_seed: int = 0
    ) -> StragglerDraws:
        """Draw ``seeds`` realisations; seed index ``i`` uses the stream keyed by
        ``(seed, first_seed + i)``, apart from the failures' streams.

        Raises:
            ValueError: for a non-positive horizon or seed count.
        """
        check_number("horizon_s", horizon_s, positive=True)
        check_positive_int("seeds", seeds)
        check_index("first_seed", first_seed)
        mean = self.rate_per_gpu_hour * job.gpus * horizon_s / 3600.0
        parts = []
        for i in range(seeds):
            rng = np.random.default_rng([int(seed), _STREAM, first_seed + i])
            n = int(rng.poisson(mean)) if self.active else 0
            onset = rng.uniform(0.0, horizon_s, n)
            gpu = rng.integers(0, job.gpus, n)
            if math.isinf(self.mean_hours):
                duration = np.full(n, math.inf)
            else:
                duration = rng.exponential(self.mean_hours * 3600.0, n)
            order = np.argsort(onset, kind="stable")
            parts.append((onset[order], gpu[order] // job.layout.tp, duration[order]))
        return StragglerDraws(
            job=job,
            horizon_s=horizon_s,
            num_seeds=seeds,
            factor=self.factor,
            patience_steps=self.patience_steps,
            seed=np.repeat(np.arange(seeds), [len(p[0]) for p in parts]),
            onset_s=np.concatenate([p[0] for p in parts]),
            worker=np.concatenate([p[1] for p in parts]).astype(np.int64),
            duration_s=np.concatenate([p[2] for p in parts]),
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class StragglerDraws:
    """Slow episodes for several seeds: also the deterministic injection for tests.

    Raises:
        ValueError: if the arrays disagree in length, or name a seed, worker or onset
            outside the job and horizon.
    """

    job: Job
    horizon_s: float
    num_seeds: int
    factor: float
    patience_steps: int
    seed: np.ndarray
    onset_s: np.ndarray
    worker: np.ndarray
    """Index of the slow worker (its GPUs are ``worker * tp ..``)."""
    duration_s: np.ndarray
    """How long it would stay slow if nobody acted (``inf``: for ever)."""

    def __post_init__(self) -> None:
        n = len(self.onset_s)
        for name in ("seed", "worker", "duration_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StragglerDraws.{name} has {len(getattr(self, name))}, not {n}")
        if not self.factor >= 1:
            raise ValueError(f"StragglerDraws.factor must be >= 1, got {self.factor!r}")
        check_positive_int("StragglerDraws.patience_steps", self.patience_steps)
        for name, dtype in (("seed", np.int64), ("worker", np.int64)):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=dtype))
        for name in ("onset_s", "duration_s"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        if n and (
            self.seed.min() < 0
            or self.seed.max() >= self.num_seeds
            or self.worker.min() < 0
            or self.worker.max() >= self.job.layout.workers
            or self.onset_s.min() < 0
            or self.onset_s.max() >= self.horizon_s
            or not self.duration_s.min() >= 0
        ):
            raise ValueError(
                f"straggler draws must name seeds 0..{self.num_seeds - 1}, workers "
                f"0..{self.job.layout.workers - 1}, onsets in [0, {self.horizon_s}) s and "
                "durations >= 0"
            )

    def __len__(self) -> int:
        return len(self.onset_s)

    def detect_after_s(self, step_s: float) -> float:
        """Wall time from an onset to the runtime acting: the patience at the slow pace."""
        return self.patience_steps * step_s * self.factor

    def handled(self, step_s: float) -> np.ndarray:
        """Which episodes mitigation acts on: slow longer than the patience, and detected
        before the horizon."""
        after = self.detect_after_s(step_s)
        return (self.duration_s > after) & (self.onset_s + after < self.horizon_s)

    def counts(self, step_s: float | None = None) -> np.ndarray:
        """Episodes per seed (those mitigation acts on, given ``step_s``)."""
        weights = None if step_s is None else self.handled(step_s).astype(np.float64)
        return np.bincount(self.seed, weights=weights, minlength=self.num_seeds)

    def clock(self, step_s: float, *, mitigated: bool) -> WorkClock:
        """The job's work clock: slow while any episode lasts (cut at detection when
        ``mitigated``)."""
        duration = self.duration_s
        if mitigated:
            duration = np.minimum(duration, self.detect_after_s(step_s))
        end = np.minimum(self.onset_s + duration, self.horizon_s)
        return WorkClock.from_intervals(
            self.num_seeds, self.seed, self.onset_s, end, self.factor, self.horizon_s
        )

    def with_kills(self, events: FailureEvents, step_s: float) -> FailureEvents:
        """``events`` plus one failure of each handled straggler's worker at its detection.

        Raises:
            ValueError: if the events belong to another cluster, horizon or seed count.
        """
        if (events.cluster, events.horizon_s, events.num_seeds) != (
            self.job.cluster,
            self.horizon_s,
            self.num_seeds,
        ):
            raise ValueError("straggler draws and failure events describe different runs")
        keep = self.handled(step_s)
        tp = self.job.layout.tp
        seed = np.concatenate([events.seed, self.seed[keep]])
        time = np.concatenate([events.time_s, self.onset_s[keep] + self.detect_after_s(step_s)])
        order = np.lexsort((time, seed))
        pick = lambda a, b: np.concatenate([a, b])[order]  # noqa: E731
        return FailureEvents(
            cluster=events.cluster,
            horizon_s=events.horizon_s,
            num_seeds=events.num_seeds,
            seed=seed[order],
            time_s=time[order],
            component=pick(events.component, np.full(int(keep.sum()), _GPU, dtype=np.int8)),
            first_gpu=pick(events.first_gpu, self.worker[keep] * tp),
            num_gpus=pick(events.num_gpus, np.full(int(keep.sum()), tp, dtype=np.int64)),
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class WorkClock:
    """Work done by wall time ``t``, per seed: ``t - (1 - 1/factor) * slow(t)``, where
    ``slow(t)`` is how much of ``[0, t)`` some straggler was slow. Exactly ``t`` in a seed
    without stragglers."""

    factor: float
    span: float
    """Seed ``s``'s intervals sit at ``s * span + time`` in the sorted keys."""
    seed: np.ndarray
    key: np.ndarray
    """Start of each merged slow interval, as ``seed * span + start``; sorted."""
    start: np.ndarray
    length: np.ndarray
    before: np.ndarray
    """Slow time of the same seed before each interval."""

    @classmethod
    def from_intervals(
        cls,
        num_seeds: int,
        seed: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        factor: float,
        horizon_s: float,
    ) -> WorkClock:
        """Merge each seed's (possibly overlapping) slow intervals into a clock."""
        seeds, starts, lengths = [], [], []
        order = np.lexsort((start, seed))
        seed, start, end = seed[order], start[order], end[order]
        bounds = np.searchsorted(seed, np.arange(num_seeds + 1))
        for s in range(num_seeds):
            a, b = int(bounds[s]), int(bounds[s + 1])
            for lo, hi in _merge(start[a:b].tolist(), end[a:b].tolist()):
                seeds.append(s)
                starts.append(lo)
                lengths.append(hi - lo)
        seed_arr = np.asarray(seeds, dtype=np.int64)
        length = np.asarray(lengths, dtype=np.float64)
        first = np.searchsorted(seed_arr, seed_arr)  # index of each seed's first interval
        cum = np.concatenate([[0.0], np.cumsum(length)])
        span = 2.0 * horizon_s + 1.0
        start_arr = np.asarray(starts, dtype=np.float64)
        return cls(
            factor=float(factor),
            span=span,
            seed=seed_arr,
            key=seed_arr * span + start_arr,
            start=start_arr,
            length=length,
            before=cum[:-1] - cum[first],
        )

    def slow(self, t: np.ndarray) -> np.ndarray:
        """Slow time in ``[0, t)``; ``t``'s last axis runs over seeds."""
        t = np.asarray(t, dtype=np.float64)
        if not len(self.key):
            return np.zeros_like(t)
        s = np.broadcast_to(np.arange(t.shape[-1]), t.shape)
        k = np.searchsorted(self.key, s * self.span + t, side="right") - 1
        kk = np.maximum(k, 0)
        mine = (k >= 0) & (self.seed[kk] == s)
        inside = np.clip(t - self.start[kk], 0.0, self.length[kk])
        return np.where(mine, self.before[kk] + inside, 0.0)

    def __call__(self, t: np.ndarray) -> np.ndarray:
        """Work seconds done by wall time ``t`` (``t``'s last axis runs over seeds)."""
        slow = self.slow(t)
        return np.where(slow > 0, t - (1.0 - 1.0 / self.factor) * slow, t)

    def slow_seconds(self, num_seeds: int) -> np.ndarray:
        """Total slow time per seed."""
        return np.bincount(self.seed, weights=self.length, minlength=num_seeds)


def _merge(starts: Sequence[float], ends: Sequence[float]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in zip(starts, ends, strict=True):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
