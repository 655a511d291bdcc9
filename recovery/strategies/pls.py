"""The job's portion of lost samples (PLS): one ledger of the partial restores it accepted.

See [Note: portion of lost samples] in recovery/strategies/embedding.py. Each accepted
partial restore adds its lost samples (lost lookups over lookups per sample); a rollback
to step ``k`` removes the restores made at or after ``k`` (their steps are redone). The
job's PLS is the sum over what remains, over the samples trained. The Ray runtime and the
embedding simulator book their restores here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parallelism.checks import check_int, check_positive_int

__all__ = ["PLSEvent", "PLSLedger"]


@dataclass(frozen=True)
class PLSEvent:
    """One accepted restore, as an event reports it."""

    lost_samples: float
    """Samples whose updates it lost (lost lookups / lookups per sample)."""
    pls_event: float
    """Its own share of the samples trained."""
    pls_job: float
    """The job's PLS with it included."""


@dataclass
class PLSLedger:
    """Accepted partial restores on the current timeline (see the module docstring).

    Raises:
        ValueError: for a non-positive ``lookups_per_sample`` or ``samples_per_step``.
    """

    lookups_per_sample: int
    """Embedding lookups one sample makes (the number of tables / sparse features)."""
    samples_per_step: int
    """Samples in one step's global batch."""
    accepted: list[tuple[int, float]] = field(default_factory=list)
    """(the step the restore resumed at, its lost samples), oldest first."""

    def __post_init__(self) -> None:
        check_positive_int("lookups_per_sample", self.lookups_per_sample)
        check_positive_int("samples_per_step", self.samples_per_step)

    def _share(self, lost_samples: float, committed: int) -> float:
        samples = committed * self.samples_per_step
        if samples:
            return lost_samples / samples
        return 0.0 if lost_samples == 0 else math.inf

    def if_accepted(self, lost_lookups: int, *, committed: int) -> float:
        """The job's PLS if a restore losing ``lost_lookups`` is accepted after
        ``committed`` committed steps (nothing is booked)."""
        check_int("lost_lookups", lost_lookups, minimum=0)
        lost = lost_lookups / self.lookups_per_sample
        return self._share(sum(s for _, s in self.accepted) + lost, committed)

    def accept(self, lost_lookups: int, *, committed: int, at: int) -> PLSEvent:
        """Book a restore that resumed at step ``at``."""
        pls_job = self.if_accepted(lost_lookups, committed=committed)
        lost = lost_lookups / self.lookups_per_sample
        self.accepted.append((at, lost))
        samples = committed * self.samples_per_step
        return PLSEvent(
            lost_samples=lost, pls_event=lost / samples if samples else 0.0, pls_job=pls_job
        )

    def rolled_back(self, step: int) -> None:
        """A rollback to ``step``: the restores in the abandoned steps are gone."""
        self.accepted = [(c, s) for c, s in self.accepted if c < step]

    @property
    def total(self) -> float:
        """Lost samples of every restore still on the timeline."""
        return sum(s for _, s in self.accepted)
