"""The recovery vocabulary: one enum per set of names, used by every package.

The values are the strings written to ``events.jsonl`` and accepted on the command line,
so they never change; this is the only module that spells them (the planner, the policy,
the runtime's executor, events, the command line and every simulator use these members).
`Mode` is what a policy chooses between, a vocabulary of its own that shares the word
``restart`` with `Strategy`. `ModeName` and `StrategyName` are the same values as
``Literal`` types, for configs that take the names as strings (`RecoveryPolicy.strategy`,
``allowed``); this module checks, on import, that they list exactly the members' values.
"""

from __future__ import annotations

import enum
import sys
from typing import Literal, get_args

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """`enum.StrEnum` for Python 3.10: members are their values as strings."""

        def __str__(self) -> str:
            return str(self.value)


__all__ = [
    "APPROXIMATE",
    "FailureCause",
    "Mode",
    "ModeName",
    "StrEnum",
    "Strategy",
    "StrategyName",
    "Tier",
]


class Strategy(StrEnum):
    """How one lost unit of state comes back (docs/DESIGN.md, Recovery hierarchy)."""

    REPLICA_COPY = "replica_copy"
    """Copied from a live replica of the same stage (exact)."""
    SHARD_MIRROR = "shard_mirror"
    """A sharded unit (ZeRO-1 optimizer shard, embedding rows) from its ring mirror (exact)."""
    NEIGHBOR_AVERAGE = "neighbor_average"
    """CheckFree: the gradient-norm-weighted average of the neighbouring stages."""
    EDGE_COPY = "edge_copy"
    """CheckFree+: a first/last stage copied from its swap partner."""
    EMBEDDING_PARTIAL = "embedding_partial"
    """CPR: an embedding shard restored with some rows stale, within the PLS budget."""
    ROLLBACK = "rollback"
    """Every worker restores the newest consistent snapshot (peer tier, else durable)."""
    RESTART = "restart"
    """The baseline: every worker restarted cold from the last checkpoint."""
    REPLICA_VOTE = "replica_vote"
    """Silent corruption: a worker whose fingerprint differs from its stage group's majority
    is rebuilt from a replica of that majority (exact)."""
    SHRINK = "shrink"
    """Elastic: no replacement could be had in time, so the job trains on without the lost
    workers; the complete pipelines compute the missing ones' microbatches (same global
    batch; nothing is rebuilt yet)."""
    GROW = "grow"
    """Elastic: a worker a shrink left out is started again and copied from a live replica
    of its stage (exact), and the job is back at full strength."""

    @property
    def exact(self) -> bool:
        """Whether the rebuilt state is the state that was lost."""
        return self not in APPROXIMATE


APPROXIMATE = frozenset({Strategy.NEIGHBOR_AVERAGE, Strategy.EDGE_COPY, Strategy.EMBEDDING_PARTIAL})
"""Strategies whose result is not the state the lost worker had."""


class Tier(StrEnum):
    """Where a rollback's snapshot comes from."""

    PEER = "peer"
    """Workers' memory: each worker's own copy and its buddy's."""
    DURABLE = "durable"
    """Files (torch.distributed.checkpoint), checksummed; survives the driver."""


class Mode(StrEnum):
    """What a policy does about every failure (``RecoveryPolicy.strategy``, the command line's
    ``--strategy``); `Strategy` names how one recovery rebuilt each lost unit."""

    AUTO = "auto"
    """The recovery hierarchy: rebuild lost workers from live redundancy, roll back only
    when it is exhausted."""
    RESTART = "restart"
    """The baseline: every failure is a `Strategy.RESTART` from the last checkpoint."""


class FailureCause(StrEnum):
    """Why a recovery started (`Failure.cause`, an event's ``cause``), most specific first
    where several apply (recovery/runtime/detection.py `failure_of`)."""

    NUMERICAL = "numerical fault"
    """A non-finite loss or gradient norm: the live state itself is suspect."""
    CORRUPTED = "corrupted"
    """The fingerprint vote found replicas that disagree (silent data corruption)."""
    HUNG = "hung"
    """A worker made no progress for the hang timeout and was killed."""
    NODE_LOST = "node lost"
    """A whole node went, with every worker on it."""
    KILLED = "killed"
    """A worker died."""
    COMMUNICATION = "communication error"
    """A call broke on the network with every worker alive: the step is retried."""
    GROW = "grow"
    """Nothing failed: spares are ready for the workers a shrink left out."""
    STRAGGLER = "straggler"
    """A worker stayed slower than the other replicas of its stage (see [Note: stragglers]
    in recovery/runtime/stragglers.py): it is replaced as if it had died."""
    DRIVER_RESTARTED = "driver restarted"
    """The driver died and a new one resumed from a durable snapshot."""


ModeName = Literal["auto", "restart"]
"""A `Mode` by its value."""
StrategyName = Literal[
    "replica_copy",
    "shard_mirror",
    "neighbor_average",
    "edge_copy",
    "embedding_partial",
    "rollback",
    "restart",
    "replica_vote",
    "shrink",
    "grow",
]
"""A `Strategy` by its value."""

# The Literals are for type checkers, the enums the vocabulary: they must never drift apart.
assert get_args(ModeName) == tuple(m.value for m in Mode), "ModeName != Mode"
assert get_args(StrategyName) == tuple(s.value for s in Strategy), "StrategyName != Strategy"
