"""Where the convergence simulator's failures come from: one small protocol, three sources.

`FailureSource` is the role (which stages fail in an attempted step); `FailureProcess`
draws them at an hourly rate with common random numbers, `ScheduledFailures` fixes them
(deterministic injection for tests and ablations), and `ModelFailures` draws them from any
of the cluster simulator's failure models (``simulations/traces.py``: exponential,
Weibull, mixed per-component rates, a replayed trace), so both simulators can run on the
same failures. tests/test_failure_sources.py holds every source to the same contract.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from parallelism.checks import check_index, check_number, check_positive_int
from simulations.traces import ClusterShape, FailureModel

__all__ = ["FailureProcess", "FailureSource", "ModelFailures", "ScheduledFailures"]


@runtime_checkable
class FailureSource(Protocol):
    """Anything `run_convergence` draws failures from."""

    @property
    def hourly_rate(self) -> float:
        """The failure rate per stage-hour (a label for results)."""
        ...

    @property
    def seed(self) -> int:
        """The seed of the draws (a label for results)."""
        ...

    def probability(self, step_s: float) -> float:
        """Per-stage failure probability of one step of ``step_s`` seconds (0: not a rate)."""
        ...

    def failed(self, attempt: int, num_stages: int, step_s: float) -> list[int]:
        """The stages that fail during attempt ``attempt`` of a step lasting ``step_s``."""
        ...


@dataclass(frozen=True, kw_only=True)
class FailureProcess:
    """Independent per-stage failures at an hourly rate, drawn with common random numbers.

    Raises:
        ValueError: if ``hourly_rate`` is outside [0, 1) or ``seed`` is negative.
    """

    hourly_rate: float
    """Probability that a given stage fails within an hour (0.05 = 5 % per stage-hour)."""
    seed: int = 0
    """Seeds the uniforms; the same seed gives every strategy the same draws."""

    def __post_init__(self) -> None:
        rate = self.hourly_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
            raise ValueError(f"FailureProcess hourly_rate must be in [0, 1), got {rate!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(
                f"FailureProcess seed must be a non-negative integer, got {self.seed!r}"
            )

    def probability(self, step_s: float) -> float:
        """Per-stage failure probability of one step of ``step_s`` seconds:
        ``1 - (1 - h) ** (step_s / 3600)``."""
        return 1.0 - (1.0 - self.hourly_rate) ** (step_s / 3600.0)

    def uniforms(self, attempt: int, num_stages: int) -> np.ndarray:
        """The ``num_stages`` uniforms of attempt ``attempt`` (a pure function of seed, attempt)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0xC4EC, attempt]))
        return rng.random(num_stages)

    def failed(self, attempt: int, num_stages: int, step_s: float) -> list[int]:
        """Stages that fail during attempt ``attempt`` of a step lasting ``step_s``."""
        p = self.probability(step_s)
        if p <= 0:
            return []
        return [int(s) for s in np.flatnonzero(self.uniforms(attempt, num_stages) < p)]


@dataclass(frozen=True, kw_only=True)
class ScheduledFailures:
    """Failures at fixed attempts: ``kills[attempt]`` = the stages lost in that attempt.

    Deterministic injection for tests and ablations; has `FailureProcess`'s interface.
    ``hourly_rate`` is only a label for results.

    Raises:
        ValueError: if an attempt is negative or a stage list is empty.
    """

    kills: Mapping[int, tuple[int, ...]]
    hourly_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        kills = {int(a): tuple(sorted(set(s))) for a, s in dict(self.kills).items()}
        for attempt, stages in kills.items():
            if attempt < 0 or not stages or min(stages) < 0:
                raise ValueError(f"bad scheduled failure at attempt {attempt}: stages {stages}")
        object.__setattr__(self, "kills", kills)

    def probability(self, step_s: float) -> float:
        """Not a rate: 0 (reported in results only)."""
        return 0.0

    def failed(self, attempt: int, num_stages: int, step_s: float) -> list[int]:
        """The stages scheduled to fail in ``attempt``.

        Raises:
            ValueError: if a scheduled stage is outside ``0..num_stages-1``.
        """
        stages = list(self.kills.get(attempt, ()))
        if stages and max(stages) >= num_stages:
            raise ValueError(f"scheduled failure of stage {max(stages)} with {num_stages} stages")
        return stages


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelFailures:
    """A cluster failure model (`simulations.traces.FailureModel`) as a `FailureSource`.

    Each pipeline stage is one device of a cluster of ``stages`` devices, ``gpus_per_node``
    to a node and ``nodes_per_rack`` nodes to a rack, so a node or rack failure takes its
    stages together. The model is sampled once, over ``horizon_s``, with ``seed``; attempt
    ``a`` of a step lasting ``step_s`` is exposed to the failures in
    ``[a * step_s, (a + 1) * step_s)`` of that failure clock: the clock runs while steps
    compute, as `FailureProcess`'s per-step draws assume too.

    Raises:
        ValueError: for a bad count, horizon or seed.
    """

    model: FailureModel
    stages: int
    horizon_s: float
    """Failure-clock seconds sampled; an attempt beyond it is an error, never silence."""
    seed: int = 0
    gpus_per_node: int = 1
    nodes_per_rack: int = 1
    _cluster: ClusterShape = field(init=False, repr=False)
    _events: tuple[np.ndarray, np.ndarray, np.ndarray] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_positive_int("ModelFailures stages", self.stages)
        check_number("ModelFailures horizon_s", self.horizon_s, positive=True)
        check_index("ModelFailures seed", self.seed)
        cluster = ClusterShape(
            gpus=self.stages, gpus_per_node=self.gpus_per_node, nodes_per_rack=self.nodes_per_rack
        )
        events = self.model.sample(cluster, self.horizon_s, seed=self.seed)
        object.__setattr__(self, "_cluster", cluster)
        object.__setattr__(self, "_events", (events.time_s, events.first_gpu, events.num_gpus))

    @property
    def hourly_rate(self) -> float:
        """The probability of a failure event per stage-hour (a label for results)."""
        per_stage = self.model.expected_events(self._cluster, 3600.0) / self.stages
        return -math.expm1(-per_stage)

    def probability(self, step_s: float) -> float:
        """`FailureProcess`'s formula at this model's long-run `hourly_rate`."""
        return 1.0 - (1.0 - self.hourly_rate) ** (step_s / 3600.0)

    def failed(self, attempt: int, num_stages: int, step_s: float) -> list[int]:
        """The stages some sampled failure event hits during attempt ``attempt``.

        Raises:
            ValueError: for another stage count than sampled, or an attempt past the horizon.
        """
        if num_stages != self.stages:
            raise ValueError(f"ModelFailures sampled {self.stages} stages, asked for {num_stages}")
        start, end = attempt * step_s, (attempt + 1) * step_s
        if end > self.horizon_s:
            raise ValueError(
                f"attempt {attempt} of {step_s} s steps ends at {end:.0f} s, past the sampled "
                f"horizon of {self.horizon_s:.0f} s: sample a longer one"
            )
        times, first, width = self._events
        hit = (times >= start) & (times < end)
        stages = {
            int(g) for f, w in zip(first[hit], width[hit], strict=True) for g in range(f, f + w)
        }
        return sorted(stages)
