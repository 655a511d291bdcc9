"""Failure models for the cluster simulator: when, and which, hardware dies.

A failure model draws failure events for a cluster of GPUs over a time horizon, for many
Monte Carlo seeds at once. An event takes down one *component*: a GPU, a node (all its
GPUs, e.g. a host, NIC or power failure) or a rack (all its nodes). GPUs are numbered so
that every component is a contiguous range of GPU ids (node ``n`` holds GPUs
``n*g .. n*g+g-1`` for ``g`` GPUs per node; rack ``k`` holds nodes ``k*r .. k*r+r-1``), so an
event is ``(time, first_gpu, num_gpus)``.

Models: :class:`ExponentialFailures` (constant rate per component, the per-GPU MTBF),
:class:`WeibullFailures` (infant mortality with shape < 1, wear-out with shape > 1; a
failed component is replaced by a new one), :class:`MixedFailures` (independent models
superposed, e.g. GPU and node failures) and :class:`TraceReplay` (a CSV trace of
``time_s,component`` rows). :func:`llama3_failures` gives the default: the interruption
rate of Llama 3's pre-training, 419 interruptions in 54 days on 16,384 GPUs (RESEARCH.md).

Every seed has its own random stream keyed by ``(seed, seed index)``, so seed ``i`` draws
the same failures whether 10 or 1,000 seeds are sampled, and chunks of seeds can be
simulated apart (e.g. on a Ray cluster) and merged.
"""

from __future__ import annotations

import csv
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "COMPONENTS",
    "LLAMA3_DAYS",
    "LLAMA3_GPUS",
    "LLAMA3_GPU_FAILURE_SHARE",
    "LLAMA3_GPU_MTBF_HOURS",
    "LLAMA3_INTERRUPTIONS",
    "ClusterShape",
    "ExponentialFailures",
    "FailureEvents",
    "FailureModel",
    "MixedFailures",
    "TraceReplay",
    "WeibullFailures",
    "llama3_failures",
]

COMPONENTS: tuple[str, ...] = ("gpu", "node", "rack")
"""Component kinds, in the order of :attr:`FailureEvents.component` codes."""

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_INTERRUPTIONS = 419
LLAMA3_GPU_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
"""Per-GPU mean time between job interruptions, ~50,676 h (RESEARCH.md)."""
LLAMA3_GPU_FAILURE_SHARE = 0.301 + 0.172
"""Share of Llama 3's interruptions attributed to a GPU or its HBM (30.1% + 17.2%)."""

_HOUR = 3600.0


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_positive(name: str, value: object, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or v <= 0 or (math.isinf(v) and not allow_inf):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v


def _check_component(component: str) -> int:
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {COMPONENTS}, got {component!r}")
    return COMPONENTS.index(component)


@dataclass(frozen=True, kw_only=True)
class ClusterShape:
    """The hardware a job runs on: how many GPUs, and how they group into nodes and racks.

    The last node (rack) may be partial when ``gpus`` is not a multiple of its size.

    Raises:
        ValueError: if a count is not a positive integer.
    """

    gpus: int
    """GPUs in the job."""
    gpus_per_node: int = 8
    """GPUs that a node failure takes down together."""
    nodes_per_rack: int = 2
    """Nodes that a rack failure takes down together (e.g. the Llama 3 cluster's racks
    hold two 8-GPU servers)."""

    def __post_init__(self) -> None:
        _check_int("ClusterShape.gpus", self.gpus, 1)
        _check_int("ClusterShape.gpus_per_node", self.gpus_per_node, 1)
        _check_int("ClusterShape.nodes_per_rack", self.nodes_per_rack, 1)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def racks(self) -> int:
        return -(-self.nodes // self.nodes_per_rack)

    def count(self, component: str) -> int:
        """How many components of a kind the cluster has.

        Raises:
            ValueError: for an unknown component kind.
        """
        return (self.gpus, self.nodes, self.racks)[_check_component(component)]

    def span(self, component: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """GPU ranges ``(first_gpu, num_gpus)`` of components given as (kind code, index)."""
        size = np.array([1, self.gpus_per_node, self.gpus_per_node * self.nodes_per_rack])
        width = size[component]
        first = np.asarray(index, dtype=np.int64) * width
        return first, np.minimum(first + width, self.gpus) - first


@dataclass(frozen=True, kw_only=True, eq=False)
class FailureEvents:
    """Failure events for several Monte Carlo seeds, sorted by (seed, time).

    Raises:
        ValueError: if the arrays disagree in length, name GPUs outside the cluster,
            have times outside ``[0, horizon_s)`` or are not sorted by (seed, time).
    """

    cluster: ClusterShape
    horizon_s: float
    num_seeds: int
    seed: np.ndarray
    """Seed index (0 .. num_seeds - 1) of each event."""
    time_s: np.ndarray
    """Wall-clock time of each event, seconds from the job start."""
    component: np.ndarray
    """Kind code of the failed component (an index into :data:`COMPONENTS`)."""
    first_gpu: np.ndarray
    num_gpus: np.ndarray
    offsets: np.ndarray = field(init=False)
    """``offsets[i] .. offsets[i+1]`` are seed ``i``'s events."""

    def __post_init__(self) -> None:
        _check_positive("horizon_s", self.horizon_s)
        _check_int("num_seeds", self.num_seeds, 1)
        n = len(self.time_s)
        for name in ("seed", "component", "first_gpu", "num_gpus"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"FailureEvents.{name} has {len(getattr(self, name))} entries, time_s {n}"
                )
        seed = np.asarray(self.seed, dtype=np.int64)
        time = np.asarray(self.time_s, dtype=np.float64)
        first = np.asarray(self.first_gpu, dtype=np.int64)
        width = np.asarray(self.num_gpus, dtype=np.int64)
        if n:
            if seed.min() < 0 or seed.max() >= self.num_seeds:
                raise ValueError(f"seed indices must lie in 0..{self.num_seeds - 1}")
            if not (np.all(np.isfinite(time)) and time.min() >= 0 and time.max() < self.horizon_s):
                raise ValueError(f"event times must lie in [0, {self.horizon_s}) s")
            if first.min() < 0 or width.min() < 1 or (first + width).max() > self.cluster.gpus:
                raise ValueError(
                    f"events name GPUs outside the cluster of {self.cluster.gpus} GPUs"
                )
            order_ok = (np.diff(seed) > 0) | ((np.diff(seed) == 0) & (np.diff(time) >= 0))
            if not np.all(order_ok):
                raise ValueError("FailureEvents must be sorted by (seed, time); use from_unsorted")
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "time_s", time)
        object.__setattr__(self, "component", np.asarray(self.component, dtype=np.int8))
        object.__setattr__(self, "first_gpu", first)
        object.__setattr__(self, "num_gpus", width)
        counts = np.bincount(seed, minlength=self.num_seeds)
        object.__setattr__(self, "offsets", np.concatenate([[0], np.cumsum(counts)]))

    @classmethod
    def from_unsorted(
        cls,
        *,
        cluster: ClusterShape,
        horizon_s: float,
        num_seeds: int,
        seed: np.ndarray,
        time_s: np.ndarray,
        component: np.ndarray,
        index: np.ndarray,
    ) -> FailureEvents:
        """Build from events in any order, components given as (kind code, index).

        Raises:
            ValueError: as the constructor, or if a component index is out of range.
        """
        component = np.asarray(component, dtype=np.int8)
        index = np.asarray(index, dtype=np.int64)
        counts = np.array([cluster.gpus, cluster.nodes, cluster.racks])
        if len(index) and (index.min() < 0 or np.any(index >= counts[component])):
            bad = int(np.flatnonzero((index < 0) | (index >= counts[component]))[0])
            kind = COMPONENTS[component[bad]]
            raise ValueError(
                f"{kind} {index[bad]} is outside a cluster of {cluster.count(kind)} {kind}s "
                f"({cluster.gpus} GPUs, {cluster.gpus_per_node} per node, "
                f"{cluster.nodes_per_rack} nodes per rack)"
            )
        order = np.lexsort((time_s, seed))
        first, width = cluster.span(component[order], index[order])
        return cls(
            cluster=cluster,
            horizon_s=horizon_s,
            num_seeds=num_seeds,
            seed=np.asarray(seed)[order],
            time_s=np.asarray(time_s, dtype=np.float64)[order],
            component=component[order],
            first_gpu=first,
            num_gpus=width,
        )

    def __len__(self) -> int:
        return len(self.time_s)

    def counts(self) -> np.ndarray:
        """Number of events per seed."""
        return np.diff(self.offsets)

    def select(self, mask: np.ndarray) -> FailureEvents:
        """The events where ``mask`` is true (thinning keeps the order).

        Raises:
            ValueError: if ``mask`` is not one boolean per event.
        """
        mask = np.asarray(mask)
        if mask.dtype != bool or mask.shape != self.time_s.shape:
            raise ValueError(f"mask must be {len(self)} booleans, got {mask.dtype} {mask.shape}")
        return FailureEvents(
            cluster=self.cluster,
            horizon_s=self.horizon_s,
            num_seeds=self.num_seeds,
            seed=self.seed[mask],
            time_s=self.time_s[mask],
            component=self.component[mask],
            first_gpu=self.first_gpu[mask],
            num_gpus=self.num_gpus[mask],
        )

    def to_csv(self, path: str | Path, *, seed: int = 0) -> None:
        """Write one seed's events as a trace file that :meth:`TraceReplay.from_csv` reads.

        Raises:
            ValueError: if ``seed`` is out of range or the file cannot be written.
        """
        if not 0 <= seed < self.num_seeds:
            raise ValueError(f"seed must lie in 0..{self.num_seeds - 1}, got {seed}")
        lo, hi = self.offsets[seed], self.offsets[seed + 1]
        size = np.array(
            [
                1,
                self.cluster.gpus_per_node,
                self.cluster.gpus_per_node * self.cluster.nodes_per_rack,
            ]
        )
        try:
            with open(path, "w", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                writer.writerow(["time_s", "component"])
                for i in range(lo, hi):
                    code = int(self.component[i])
                    writer.writerow(
                        [
                            repr(float(self.time_s[i])),
                            f"{COMPONENTS[code]}:{self.first_gpu[i] // size[code]}",
                        ]
                    )
        except OSError as err:
            raise ValueError(f"cannot write trace file {path}: {err}") from err


def _rngs(seed: int | Sequence[int], seeds: int, first_seed: int) -> list[np.random.Generator]:
    key = (seed,) if isinstance(seed, int | np.integer) else tuple(seed)
    for part in key:
        _check_int("seed", part, 0)
    return [np.random.default_rng([*map(int, key), first_seed + i]) for i in range(seeds)]


class FailureModel(ABC):
    """Where failure events come from: one role, several implementations."""

    @abstractmethod
    def sample_seed(
        self, cluster: ClusterShape, horizon_s: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One seed's events as unsorted arrays ``(time_s, component code, index)``."""

    @abstractmethod
    def expected_events(self, cluster: ClusterShape, horizon_s: float) -> float:
        """Mean number of events over the horizon (the long-run rate times the horizon
        for renewal models); the simulator derives the job MTBF from it."""

    @abstractmethod
    def describe(self) -> str:
        """One line for tables and plots."""

    def sample(
        self,
        cluster: ClusterShape,
        horizon_s: float,
        *,
        seeds: int = 1,
        seed: int | Sequence[int] = 0,
        first_seed: int = 0,
    ) -> FailureEvents:
        """Draw ``seeds`` independent realisations of the failure process.

        Seed index ``i`` uses the random stream keyed by ``(seed, first_seed + i)``.

        Raises:
            ValueError: for a non-positive horizon or seed count, or (trace replay) a
                component outside the cluster.
        """
        horizon_s = _check_positive("horizon_s", horizon_s)
        seeds = _check_int("seeds", seeds, 1)
        first_seed = _check_int("first_seed", first_seed, 0)
        parts = [
            self.sample_seed(cluster, horizon_s, rng) for rng in _rngs(seed, seeds, first_seed)
        ]
        seed_ix = np.repeat(np.arange(seeds), [len(p[0]) for p in parts])
        cat = [np.concatenate([p[k] for p in parts]) for k in range(3)]
        return FailureEvents.from_unsorted(
            cluster=cluster,
            horizon_s=horizon_s,
            num_seeds=seeds,
            seed=seed_ix,
            time_s=cat[0],
            component=cat[1],
            index=cat[2],
        )


@dataclass(frozen=True, kw_only=True)
class ExponentialFailures(FailureModel):
    """Each component fails at a constant rate, ``1 / mtbf``, independently of the others.

    The superposition over ``n`` components is a Poisson process of rate ``n / mtbf`` whose
    events pick a component uniformly, which is how it is drawn.

    Raises:
        ValueError: if ``mtbf_hours`` is not positive or ``component`` is unknown.
    """

    mtbf_hours: float
    """Mean time between failures of *one* component, hours (``inf``: never fails)."""
    component: str = "gpu"

    def __post_init__(self) -> None:
        _check_positive("ExponentialFailures.mtbf_hours", self.mtbf_hours, allow_inf=True)
        _check_component(self.component)

    def expected_events(self, cluster: ClusterShape, horizon_s: float) -> float:
        return cluster.count(self.component) * horizon_s / (self.mtbf_hours * _HOUR)

    def sample_seed(
        self, cluster: ClusterShape, horizon_s: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = rng.poisson(self.expected_events(cluster, horizon_s))
        times = rng.uniform(0.0, horizon_s, k)
        index = rng.integers(0, cluster.count(self.component), k)
        return times, np.full(k, _check_component(self.component), dtype=np.int8), index

    def describe(self) -> str:
        return f"exponential {self.component} MTBF {self.mtbf_hours:,.0f} h"


@dataclass(frozen=True, kw_only=True)
class WeibullFailures(FailureModel):
    """Each component's lifetime is Weibull; a failed component is replaced by a new one.

    Shape ``k < 1`` gives infant mortality (new hardware fails more often, the failure
    rate falls with age), ``k > 1`` wear-out (it rises), ``k = 1`` is exponential. The
    scale is set so that the mean lifetime is ``mtbf_hours``: ``eta = mtbf / Gamma(1 + 1/k)``.
    Every component starts the job aged ``age_hours`` (a fleet installed together);
    replacements start at age 0. Drawn exactly: which components fail at least once is
    binomial, their first failure comes from the residual-life distribution, and each
    replacement's lifetime is a fresh Weibull draw.

    Raises:
        ValueError: if ``shape``, ``mtbf_hours`` are not positive, ``age_hours`` is negative
            or ``component`` is unknown.
    """

    shape: float
    """Weibull shape ``k``."""
    mtbf_hours: float
    """Mean lifetime of one component, hours."""
    component: str = "gpu"
    age_hours: float = 0.0
    """Age of every component at the job start, hours."""

    def __post_init__(self) -> None:
        _check_positive("WeibullFailures.shape", self.shape)
        _check_positive("WeibullFailures.mtbf_hours", self.mtbf_hours)
        _check_component(self.component)
        if not (math.isfinite(self.age_hours) and self.age_hours >= 0):
            raise ValueError(f"WeibullFailures.age_hours must be >= 0, got {self.age_hours!r}")

    @property
    def scale_s(self) -> float:
        """Weibull scale ``eta`` in seconds."""
        return self.mtbf_hours * _HOUR / math.gamma(1.0 + 1.0 / self.shape)

    def expected_events(self, cluster: ClusterShape, horizon_s: float) -> float:
        return cluster.count(self.component) * horizon_s / (self.mtbf_hours * _HOUR)

    def sample_seed(
        self, cluster: ClusterShape, horizon_s: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = cluster.count(self.component)
        k, eta = self.shape, self.scale_s
        a = self.age_hours * _HOUR
        h0 = (a / eta) ** k
        p_first = -math.expm1(-(((a + horizon_s) / eta) ** k - h0))
        m = rng.binomial(n, p_first)
        index = rng.choice(n, size=m, replace=False) if m else np.empty(0, dtype=np.int64)
        u = rng.uniform(0.0, p_first, m)
        times = eta * (h0 - np.log1p(-u)) ** (1.0 / k) - a
        times = np.clip(times, 0.0, np.nextafter(horizon_s, 0.0))
        all_t, all_i = [times], [index]
        while len(times):
            times = times + eta * rng.weibull(k, len(times))
            alive = times < horizon_s
            times, index = times[alive], index[alive]
            all_t.append(times)
            all_i.append(index)
        t = np.concatenate(all_t)
        return (
            t,
            np.full(len(t), _check_component(self.component), dtype=np.int8),
            np.concatenate(all_i),
        )

    def describe(self) -> str:
        return f"Weibull k={self.shape:g} {self.component} MTBF {self.mtbf_hours:,.0f} h, age {self.age_hours:g} h"


@dataclass(frozen=True)
class MixedFailures(FailureModel):
    """Independent failure models superposed (e.g. GPU failures plus node failures).

    Raises:
        ValueError: if no model is given.
    """

    parts: tuple[FailureModel, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("MixedFailures needs at least one failure model")
        for part in self.parts:
            if not isinstance(part, FailureModel):
                raise ValueError(f"MixedFailures parts must be FailureModels, got {part!r}")

    def expected_events(self, cluster: ClusterShape, horizon_s: float) -> float:
        return sum(p.expected_events(cluster, horizon_s) for p in self.parts)

    def sample_seed(
        self, cluster: ClusterShape, horizon_s: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        draws = [
            p.sample_seed(cluster, horizon_s, r)
            for p, r in zip(self.parts, rng.spawn(len(self.parts)), strict=True)
        ]
        return tuple(np.concatenate([d[k] for d in draws]) for k in range(3))  # type: ignore[return-value]

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)


@dataclass(frozen=True, kw_only=True, eq=False)
class TraceReplay(FailureModel):
    """Replays a recorded failure trace.

    The trace covers ``duration_s`` seconds (default: up to its last event) and repeats
    with that period when the horizon is longer. With ``random_offset`` each seed starts
    the trace at its own uniformly drawn point (a circular shift), so Monte Carlo seeds
    see the same failure pattern at different phases; without it every seed replays the
    trace from its start.

    Raises:
        ValueError: if times are negative or not finite, or the arrays disagree.
    """

    time_s: np.ndarray
    component: np.ndarray
    """Kind codes (indices into :data:`COMPONENTS`)."""
    index: np.ndarray
    duration_s: float | None = None
    random_offset: bool = True
    source: str = "trace"

    def __post_init__(self) -> None:
        time = np.asarray(self.time_s, dtype=np.float64)
        comp = np.asarray(self.component, dtype=np.int8)
        index = np.asarray(self.index, dtype=np.int64)
        if not len(time) == len(comp) == len(index):
            raise ValueError("TraceReplay arrays must have one entry per event")
        if len(time) and not (np.all(np.isfinite(time)) and time.min() >= 0):
            raise ValueError("TraceReplay times must be finite and >= 0")
        if len(comp) and (comp.min() < 0 or comp.max() >= len(COMPONENTS) or index.min() < 0):
            raise ValueError("TraceReplay components must be valid kind codes with indices >= 0")
        if self.duration_s is not None:
            _check_positive("TraceReplay.duration_s", self.duration_s)
            if len(time) and time.max() > self.duration_s:
                raise ValueError(
                    f"trace events reach {time.max()} s, past duration_s={self.duration_s}"
                )
        object.__setattr__(self, "time_s", time)
        object.__setattr__(self, "component", comp)
        object.__setattr__(self, "index", index)

    @classmethod
    def from_csv(
        cls, path: str | Path, *, duration_s: float | None = None, random_offset: bool = True
    ) -> TraceReplay:
        """Read a trace file: a ``time_s,component`` header, then one row per failure.

        ``component`` is ``gpu:<id>``, ``node:<id>``, ``rack:<id>`` or a bare GPU id.
        Blank lines and lines starting with ``#`` are skipped.

        Raises:
            ValueError: if the file cannot be read, lacks the header, or a row is
                malformed (the message gives the line number).
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read trace file {path}: {err}") from err
        rows = [
            (n, line)
            for n, line in enumerate(text.splitlines(), start=1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if not rows or [c.strip().lower() for c in rows[0][1].split(",")] != [
            "time_s",
            "component",
        ]:
            raise ValueError(f"trace file {path} must start with the header 'time_s,component'")
        times, comps, idx = [], [], []
        for n, line in rows[1:]:
            cells = [c.strip() for c in line.split(",")]
            where = f"trace file {path}, line {n}"
            if len(cells) != 2:
                raise ValueError(f"{where}: expected 'time_s,component', got {line!r}")
            try:
                t = float(cells[0])
            except ValueError:
                raise ValueError(f"{where}: time {cells[0]!r} is not a number") from None
            if not math.isfinite(t) or t < 0:
                raise ValueError(f"{where}: time must be finite and >= 0, got {cells[0]!r}")
            kind, _, ident = cells[1].rpartition(":")
            kind = kind.lower() or "gpu"
            if kind not in COMPONENTS or not ident.isdigit():
                raise ValueError(
                    f"{where}: component must be gpu:<id>, node:<id>, rack:<id> or <id>, got {cells[1]!r}"
                )
            times.append(t)
            comps.append(COMPONENTS.index(kind))
            idx.append(int(ident))
        return cls(
            time_s=np.array(times, dtype=np.float64),
            component=np.array(comps, dtype=np.int8),
            index=np.array(idx, dtype=np.int64),
            duration_s=duration_s,
            random_offset=random_offset,
            source=str(path),
        )

    @property
    def period_s(self) -> float:
        """Length of one pass through the trace (0 when it cannot repeat)."""
        if self.duration_s is not None:
            return float(self.duration_s)
        return float(self.time_s.max()) if len(self.time_s) else 0.0

    def expected_events(self, cluster: ClusterShape, horizon_s: float) -> float:
        period = self.period_s
        if period <= 0:
            return float(len(self.time_s))
        return len(self.time_s) * horizon_s / period

    def sample_seed(
        self, cluster: ClusterShape, horizon_s: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        counts = np.array([cluster.gpus, cluster.nodes, cluster.racks])
        if len(self.index) and np.any(self.index >= counts[self.component]):
            bad = int(np.flatnonzero(self.index >= counts[self.component])[0])
            kind = COMPONENTS[self.component[bad]]
            raise ValueError(
                f"{self.source} names {kind} {self.index[bad]}, but the cluster has only "
                f"{cluster.count(kind)} {kind}s"
            )
        period = self.period_s
        times, comp, index = self.time_s, self.component, self.index
        if period > 0 and len(times):
            shifted = (times + (rng.uniform(0.0, period) if self.random_offset else 0.0)) % period
            if self.random_offset:
                times = shifted
            laps = max(1, math.ceil(horizon_s / period))
            times = (times[None, :] + period * np.arange(laps)[:, None]).ravel()
            comp, index = np.tile(comp, laps), np.tile(index, laps)
        keep = times < horizon_s
        return times[keep], comp[keep], index[keep]

    def describe(self) -> str:
        return f"trace {self.source} ({len(self.time_s)} events per {self.period_s / _HOUR:,.1f} h)"


def llama3_failures(*, correlated: bool = True, gpus_per_node: int = 8) -> FailureModel:
    """The Llama 3 pre-training interruption rate, per GPU (RESEARCH.md).

    419 interruptions in 54 days on 16,384 GPUs: a per-GPU MTBF of ~50,676 h. With
    ``correlated`` (the default) only the 47.3% of interruptions attributed to a GPU or
    its HBM are single-GPU failures; the rest (host, network, software, ...) are
    modelled as whole-node failures, which is pessimistic for the share of them that
    would take down one process only. The job-level interruption rate is the same
    either way.

    Raises:
        ValueError: if ``gpus_per_node`` is not a positive integer.
    """
    _check_int("gpus_per_node", gpus_per_node, 1)
    if not correlated:
        return ExponentialFailures(mtbf_hours=LLAMA3_GPU_MTBF_HOURS)
    share = LLAMA3_GPU_FAILURE_SHARE
    return MixedFailures(
        (
            ExponentialFailures(mtbf_hours=LLAMA3_GPU_MTBF_HOURS / share),
            ExponentialFailures(
                mtbf_hours=LLAMA3_GPU_MTBF_HOURS / ((1.0 - share) * gpus_per_node),
                component="node",
            ),
        )
    )
