"""Where a simulated job's GPUs sit: its pipeline x data x tensor-parallel layout and nodes.

See ``[Note: simulator model]`` in :mod:`simulations.cluster` (Job) for the placement rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallelism.checks import check_positive_int
from simulations.traces import ClusterShape

__all__ = ["Job", "Layout"]


def _pos_int(name: str, value: object) -> int:
    # numpy integers count (sweeps and layouts are often computed with numpy).
    return check_positive_int(name, int(value) if isinstance(value, np.integer) else value)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a job's GPUs are split: ``pp`` pipeline stages x ``dp`` replicas x ``tp`` GPUs.

    Raises:
        ValueError: if a degree is not a positive integer.
    """

    pp: int
    """Pipeline stages per replica."""
    dp: int
    """Data-parallel pipeline replicas."""
    tp: int = 1
    """GPUs per worker (tensor parallelism)."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            _pos_int(f"Layout.{name}", getattr(self, name))

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def workers(self) -> int:
        return self.pp * self.dp

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``"pp=16,dp=128,tp=8"`` (any order; ``tp`` defaults to 1).

        Raises:
            ValueError: on an unknown key, a missing ``pp``/``dp`` or a non-integer value.
        """
        values: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("pp", "dp", "tp") or key in values:
                raise ValueError(f"bad layout {text!r}: expected 'pp=<n>,dp=<n>[,tp=<n>]'")
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(
                    f"bad layout {text!r}: {key}={value!r} is not an integer"
                ) from None
        if "pp" not in values or "dp" not in values:
            raise ValueError(f"bad layout {text!r}: pp and dp are required")
        return cls(**values)

    @classmethod
    def default_for(cls, gpus: int) -> Layout:
        """A plausible layout for ``gpus``: tp=8 when it divides, up to 16 stages.

        Raises:
            ValueError: if ``gpus`` is not a positive integer.
        """
        gpus = _pos_int("gpus", gpus)
        tp = 8 if gpus % 8 == 0 else 1
        pp = next(p for p in (16, 8, 4, 2, 1) if (gpus // tp) % p == 0)
        return cls(pp=pp, dp=gpus // (tp * pp), tp=tp)

    def __str__(self) -> str:
        return f"pp={self.pp},dp={self.dp},tp={self.tp}"


@dataclass(frozen=True, kw_only=True)
class Job:
    """A training job: its size, its layout and the hardware grouping it runs on.

    Raises:
        ValueError: if ``pp * dp * tp`` differs from ``gpus`` or a count is not positive.
    """

    gpus: int
    layout: Layout
    gpus_per_node: int = 8
    nodes_per_rack: int = 2

    def __post_init__(self) -> None:
        _pos_int("Job.gpus", self.gpus)
        _pos_int("Job.gpus_per_node", self.gpus_per_node)
        _pos_int("Job.nodes_per_rack", self.nodes_per_rack)
        if not isinstance(self.layout, Layout):
            raise ValueError(f"Job.layout must be a Layout, got {self.layout!r}")
        if self.layout.gpus != self.gpus:
            raise ValueError(
                f"layout {self.layout} has {self.layout.gpus} GPUs but the job has {self.gpus}: "
                "pp * dp * tp must equal the number of GPUs"
            )

    @property
    def cluster(self) -> ClusterShape:
        return ClusterShape(
            gpus=self.gpus, gpus_per_node=self.gpus_per_node, nodes_per_rack=self.nodes_per_rack
        )

    @property
    def partner_offset(self) -> int:
        """Distance, in nodes, from a node to the node holding its snapshot copy (0: none)."""
        nodes = self.cluster.nodes
        if nodes == 1:
            return 0
        per_replica = (self.layout.pp * self.layout.tp) // self.gpus_per_node
        return per_replica if 0 < per_replica < nodes else 1

    def __str__(self) -> str:
        return f"{self.gpus:,} GPUs ({self.layout})"
