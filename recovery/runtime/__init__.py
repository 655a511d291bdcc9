"""The runtime: a small controller phase machine over interfaces.

- `controller`: `Controller`, the phase machine (`Phase`, one-transition `advance`).
- `group`: `WorkerGroup`, the workers as the controller sees them; `ray_group` (Ray
  actors) and `thread_group` (threads of this process, for tests) implement it.
- `detection`: await a step, abort everyone at the first failure, find hangs.
- `ledger`: what redundancy exists; produces the planner's `Redundancy`.
- `persistence`: when snapshots and checkpoints are taken; resuming after a driver death.
- `executor`: a `RecoveryPlan` turned into transfers, one function per strategy.
- `layouts`: what differs per kind of state (replicated stages, ZeRO-1, sharded tables).
- `records`: step records, failures and the events they become.
"""

from recovery.runtime.controller import Controller, ControllerConfig, Phase
from recovery.runtime.group import Call, CallResults, WorkerGroup, WorkerLost
from recovery.runtime.records import StepRecord
from recovery.runtime.thread_group import ThreadWorkerGroup

__all__ = [
    "Call",
    "CallResults",
    "Controller",
    "ControllerConfig",
    "Phase",
    "StepRecord",
    "ThreadWorkerGroup",
    "WorkerGroup",
    "WorkerLost",
]
