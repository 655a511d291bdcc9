"""The names of simulated policies that are not recovery strategies.

A *strategy* (`recovery.names.Strategy`) is how one lost unit of state comes back; a
simulated *policy* is what a simulator compares: a combination of strategies, snapshot
schedules and fallbacks. Where a policy is one strategy of the hierarchy it is named by
that `Strategy` member (``replica_copy``, ``embedding_partial``); the others are named
here, so that no name means two things. The values are what users type on the command
line and what result files hold, so they never change.
"""

from __future__ import annotations

from recovery.names import StrEnum

__all__ = ["SimulatedPolicy"]


class SimulatedPolicy(StrEnum):
    """A simulated policy that is not a single recovery strategy."""

    NONE = "none"
    """No failures: the ideal every other policy is measured against."""
    CHECKPOINT_RESTART = "checkpoint_restart"
    """The baseline torchrun / Ray Train give: `Strategy.RESTART` from the durable
    checkpoint (cluster simulator)."""
    PEER_SNAPSHOT = "peer_snapshot"
    """Gemini-style: `Strategy.ROLLBACK` from the peer tier on every failure (cluster
    simulator)."""
    CHECKFREE = "checkfree"
    """`Strategy.REPLICA_COPY`, else `Strategy.NEIGHBOR_AVERAGE` for intermediate stages,
    else `Strategy.ROLLBACK`."""
    CHECKFREE_PLUS = "checkfree+"
    """As CHECKFREE, and `Strategy.EDGE_COPY` for the first and last stages."""
    CHECKPOINT = "checkpoint"
    """`Strategy.ROLLBACK` to periodic durable checkpoints (convergence simulator)."""
    REDUNDANT = "redundant"
    """Bamboo-style redundant computation: a neighbour's copy finishes the step
    (convergence simulator); not a recovery of lost state."""
    PARTIAL = "partial"
    """CPR: `Strategy.EMBEDDING_PARTIAL` (or `Strategy.SHARD_MIRROR` where the rows are
    exact) within the PLS budget, else `Strategy.ROLLBACK` (embedding simulator)."""
