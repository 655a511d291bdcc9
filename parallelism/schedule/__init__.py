"""Microbatch schedules as data: what every pipeline stage does, in order, during one step.

A pipeline of ``S`` stages runs ``M`` microbatches per step. Microbatch ``m`` visits the
stages in the order of its *route* (normally ``0, 1, ..., S-1``; CheckFree+ swaps the first
two and the last two stages on odd microbatches). A :class:`Schedule` lists, for each stage,
the :class:`Action` s it performs -- receive, forward, send, backward -- and is checked by
:func:`validate` (counts, order, peers, FIFO channel matching, deadlock freedom) and timed by
:func:`dry_run` before any process runs it. :func:`gpipe`, :func:`one_f_one_b` and
:func:`forward_only` generate schedules for any routes.

- `parallelism.schedule.actions`: `Op`, `Action`, `Schedule`, routes, `ScheduleError`.
- `parallelism.schedule.validation`: `validate` ([Note: schedule semantics]), `dry_run`.
- `parallelism.schedule.generation`: the generators and `build_schedule` ([Note: schedule
  generation]).
"""

from parallelism.schedule.actions import (
    Action,
    Op,
    Route,
    Schedule,
    ScheduleError,
    natural_routes,
    swapped_routes,
)
from parallelism.schedule.generation import (
    SCHEDULES,
    build_schedule,
    forward_only,
    gpipe,
    one_f_one_b,
)
from parallelism.schedule.validation import DryRun, dry_run, theoretical_bubble, validate

__all__ = [
    "SCHEDULES",
    "Action",
    "DryRun",
    "Op",
    "Route",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "dry_run",
    "forward_only",
    "gpipe",
    "natural_routes",
    "one_f_one_b",
    "swapped_routes",
    "theoretical_bubble",
    "validate",
]
