"""Failure injection as library code: one `FailureSchedule` drives tests, the CLI and experiments.

- ``schedule``: what strikes when -- `FailureSchedule` and its faults (`Kill`, `Hang`,
  `Corrupt`, `BitFlip`, `Slow`, `KillNode`), `KillPoint`, the text form.
- ``injection``: `InjectedFaults`, the schedule armed step by step by the controller.
- ``monkey``: `ChaosMonkey`, SIGKILLs from outside the library at wall-clock times.
- ``throttle``: `Throttle`, a process stopped and continued in a duty cycle from outside
  (a straggler the library knows nothing of).
- ``exits``: `expect_exit`, the deaths the job causes on purpose (logged in one line).

This package imports nothing from the workers, the groups or the runtime: they import it.
"""

from recovery.faults.exits import EXPECTED_EXITS, expect_exit
from recovery.faults.injection import Armed, InjectedFaults, fault_time
from recovery.faults.monkey import ChaosMonkey, KillRecord, PlannedKill, kill_process, kill_schedule
from recovery.faults.schedule import (
    BitFlip,
    Corrupt,
    FailureSchedule,
    Fault,
    Hang,
    Kill,
    KillNode,
    KillPoint,
    Slow,
    WorkerFault,
)
from recovery.faults.throttle import Throttle

__all__ = [
    "EXPECTED_EXITS",
    "Armed",
    "BitFlip",
    "ChaosMonkey",
    "Corrupt",
    "FailureSchedule",
    "Fault",
    "Hang",
    "InjectedFaults",
    "Kill",
    "KillNode",
    "KillPoint",
    "KillRecord",
    "PlannedKill",
    "Slow",
    "Throttle",
    "WorkerFault",
    "expect_exit",
    "fault_time",
    "kill_process",
    "kill_schedule",
]
