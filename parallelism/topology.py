"""Where every worker sits in a pipeline x data-parallel job.

A job of ``stages`` pipeline stages and ``replicas`` data-parallel pipeline replicas has
``stages * replicas`` workers. Worker ``(s, r)`` holds stage ``s`` of pipeline replica ``r``;
its global rank is ``r * stages + s`` so that one pipeline's ranks are contiguous. The
*stage group* of ``s`` is the set of replicas of stage ``s`` (they all-reduce gradients);
*pipeline* ``r`` is the set of stages of replica ``r`` (they pass activations).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Worker:
    """One worker's coordinates: pipeline stage and data-parallel replica."""

    stage: int
    replica: int

    def __str__(self) -> str:
        return f"({self.stage},{self.replica})"


@dataclass(frozen=True)
class Topology:
    """A pipeline-parallel x data-parallel layout of ``stages * replicas`` workers.

    Raises:
        ValueError: if ``stages`` or ``replicas`` is not a positive integer.
    """

    stages: int
    replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("stages", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology {name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def rank(self, stage: int, replica: int) -> int:
        """Global rank of worker ``(stage, replica)``."""
        self._check(stage, replica)
        return replica * self.stages + stage

    def worker(self, rank: int) -> Worker:
        """Coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a job of {self.world_size} workers")
        return Worker(stage=rank % self.stages, replica=rank // self.stages)

    def workers(self) -> Iterator[Worker]:
        """All workers in rank order."""
        return (self.worker(rank) for rank in range(self.world_size))

    def stage_group(self, stage: int) -> list[int]:
        """Global ranks of the replicas of ``stage``, in replica order."""
        self._check(stage, 0)
        return [self.rank(stage, r) for r in range(self.replicas)]

    def pipeline(self, replica: int) -> list[int]:
        """Global ranks of the stages of pipeline ``replica``, in stage order."""
        self._check(0, replica)
        return [self.rank(s, replica) for s in range(self.stages)]

    def neighbours(self, stage: int) -> tuple[int | None, int | None]:
        """The stages before and after ``stage`` in the natural order (``None`` at the ends)."""
        self._check(stage, 0)
        prev = stage - 1 if stage > 0 else None
        nxt = stage + 1 if stage < self.stages - 1 else None
        return prev, nxt

    def _check(self, stage: int, replica: int) -> None:
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} outside 0..{self.stages - 1}")
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} outside 0..{self.replicas - 1}")

    def __str__(self) -> str:
        return f"{self.stages}x{self.replicas}"
