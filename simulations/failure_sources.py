"""Where the convergence simulator's failures come from: one small protocol, two sources.

`FailureSource` is the role (which stages fail in an attempted step); `FailureProcess`
draws them at an hourly rate with common random numbers, `ScheduledFailures` fixes them
(deterministic injection for tests and ablations).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["FailureProcess", "FailureSource", "ScheduledFailures"]


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
