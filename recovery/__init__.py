"""What happens when workers die: detection, planning, strategies, the Ray runtime, the public API."""

from recovery.errors import RecoveryError, RedundancyExhausted
from recovery.spec import TrainSpec
from recovery.trainer import FitResult, Trainer

__all__ = [
    "FitResult",
    "RecoveryError",
    "RedundancyExhausted",
    "TrainSpec",
    "Trainer",
]
