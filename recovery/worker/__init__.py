"""The worker: one pipeline stage of one replica, run as a Ray actor (or a thread in tests).

The controller calls a worker's methods by the methods themselves
(``group.submit(rank, StageWorker.commit, step)``; a group runs them as
``actor.<name>.remote(...)`` under Ray, on a thread for thread workers), so every part
below adds its methods to the one class `StageWorker`:

- ``stage``: `StageWorker` itself -- the two-phase step ([Note: two-phase step] is here),
  the injected faults that strike inside it, and abandoning it for a recovery.
- ``lifecycle``: `WorkerLifecycle`, the base that owns the state every part reads, and
  setup, join and leave a generation, reset, warm.
- ``snapshots``: peer snapshots, durable snapshots and restart checkpoints, each call a
  line over the worker's `SnapshotKeeper`.
- ``keeper``: `SnapshotKeeper`, the snapshots one worker holds (the copies held, the
  exchange thread, the durable writes in flight).
- ``transfers``: state moved between workers -- replica copies, ZeRO-1 shards and
  mirrors, CheckFree(+) rebuilds.
- ``reports``: what a worker answers the controller: `StepReport`, `WorkerInfo`,
  `is_comm_error`.
- ``callbacks``: the user's callbacks as a worker calls them (`guard_callbacks`).
- ``memory``: a worker process keeps the memory it has touched, so a recovery writes into
  warm pages.
- ``table``: `TableWorker`, a `StageWorker` for row-sharded embedding tables
  (`dlrm_spec`): one row shard of every table plus a dense replica. Not imported
  here; `recovery.runtime.layouts` picks it for such a spec.
"""

from recovery.worker.reports import StepReport, WorkerInfo, is_comm_error
from recovery.worker.stage import StageWorker

__all__ = ["StageWorker", "StepReport", "WorkerInfo", "is_comm_error"]
