"""The runtime: a small controller phase machine over interfaces.

- `controller`: `Controller`, the phase machine (`Phase`, one-transition `advance`).
- `states`: one class per phase, carrying what it works on (`Running`, `Recovering`, ...).
- `steps`: `StepRunner`, the failure-free step protocol: `advance() -> Committed | Failed`.
- `decisions`: when to grow, retry, shrink or give up -- pure functions returning enums.
- `replacing`: workers for the lost ranks, or an elastic job without them.
- `membership`: placement, lost nodes, spares, survivors leaving, generations on the store.
- `elastic`: shrinking past a lost replica and growing back ([Note: elastic shrink]).
- `detection`: await a step, abort everyone at the first failure, find hangs.
- `ledger`: what redundancy exists; produces the planner's `Redundancy`.
- `persistence`: when snapshots and checkpoints are taken; resuming after a driver death.
- `executor`: a `RecoveryPlan` turned into transfers, one function per strategy.
- `layouts`: what differs per kind of state (replicated stages, ZeRO-1, sharded tables).
- `records`: step records, failures and the events they become.
- `result`: `FitResult`, what a fit returns (losses, metrics, events, final states).
"""

from recovery.runtime.controller import Controller, ControllerConfig, Phase
from recovery.runtime.records import StepRecord
from recovery.runtime.result import FitResult

__all__ = [
    "Controller",
    "ControllerConfig",
    "FitResult",
    "Phase",
    "StepRecord",
]
