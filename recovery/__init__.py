"""What happens when workers die: detection, planning, strategies, the Ray runtime, the public API."""

from parallelism.datasets import batches_from_dataset
from parallelism.spec import TrainSpec
from recovery.errors import RecoveryError, RedundancyExhausted
from recovery.events import RecoveryEvent
from recovery.faults import BitFlip, Corrupt, FailureSchedule, Hang, Kill, KillNode, KillPoint
from recovery.policy import MirrorPolicy, RecoveryPolicy, RestartBaseline, SnapshotPolicy, Timeouts
from recovery.strategies.checkfree import CheckFreeConfig
from recovery.trainer import FitResult, Trainer

__all__ = [
    "BitFlip",
    "CheckFreeConfig",
    "Corrupt",
    "FailureSchedule",
    "FitResult",
    "Hang",
    "Kill",
    "KillNode",
    "KillPoint",
    "MirrorPolicy",
    "RecoveryError",
    "RecoveryEvent",
    "RecoveryPolicy",
    "RedundancyExhausted",
    "RestartBaseline",
    "SnapshotPolicy",
    "Timeouts",
    "TrainSpec",
    "Trainer",
    "batches_from_dataset",
]
