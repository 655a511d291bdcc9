"""What happens when workers die: detection, planning, strategies, the Ray runtime, the public API.

Bottom layer first (tests/test_layers.py holds the order; nothing imports upward):

- ``names``, ``errors``, ``events``: the vocabulary, the domain errors, a recovery's record.
- ``wire``: the JSON header format of whatever travels or is stored besides tensor bytes.
- ``strategies/``: the recovery math (CheckFree, CheckFree+, embedding mirrors, PLS).
- ``rundir``: the run folder (metrics, events, summary, the loss plot).
- ``reference``: the single-process oracle run, and `differences` against it.
- ``state``: `WorkerState` and `Progress`, what one worker holds, declared once.
- ``policy``: `RecoveryPolicy`, what the job may do when workers die.
- ``integrity/``: fingerprints of a state and the vote that finds a corrupted replica.
- ``transport/``: moving a worker's state to a peer (process group, same host).
- ``snapshots/``: peer and durable snapshots, restart checkpoints, the resume identity.
- ``faults/``: failure injection (the schedule, its arming, the chaos monkey).
- ``planner``: `plan(...) -> RecoveryPlan`, pure.
- ``worker/``: `StageWorker` (and `TableWorker`), one stage of one replica.
- ``groups/``: the worker processes (threads or Ray actors) and the Ray plumbing.
- ``runtime/``: the controller's phase machine over a worker group.
- ``callbacks/``: `Callback`, user code called at each step and recovery; TensorBoard files.
- ``trainer``: `Trainer` / `FitResult`, the public entry point.
- ``cli/``: the programs (``checkfree train``, ``chaos``, ``gpu-check``; dispatched by `simulations.cli.commands`).
"""

from parallelism.datasets import batches_from_dataset
from parallelism.spec import TrainSpec
from recovery.callbacks import Callback, TensorBoardLogger
from recovery.errors import RecoveryError, RedundancyExhausted
from recovery.events import RecoveryEvent
from recovery.faults import (
    BitFlip,
    Corrupt,
    FailureSchedule,
    Hang,
    Kill,
    KillNode,
    KillPoint,
    Slow,
)
from recovery.policy import (
    MirrorPolicy,
    RecoveryPolicy,
    RestartBaseline,
    SnapshotPolicy,
    StragglerPolicy,
    Timeouts,
)
from recovery.strategies.checkfree import CheckFreeConfig
from recovery.trainer import FitResult, Trainer

__all__ = [
    "BitFlip",
    "Callback",
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
    "Slow",
    "SnapshotPolicy",
    "StragglerPolicy",
    "TensorBoardLogger",
    "Timeouts",
    "TrainSpec",
    "Trainer",
    "batches_from_dataset",
]
