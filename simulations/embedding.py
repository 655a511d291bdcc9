"""Embedding-table recovery under failures, in one process: the CPR study with shard mirrors.

``W`` workers of a row-sharded DLRM (`parallelism.dlrm.InProcessDLRM`: each worker's own
shard, dense replica and exchange code, as threads) train on synthetic click logs with a
planted truth (`parallelism.clicks.ClickLogs`) while a `recovery.faults.FailureSchedule`
kills workers. Each strategy recovers with the pure functions of
`recovery.strategies.embedding` and is charged a modelled wall-clock cost; the result is
held-out AUC and log loss against modelled time, and where the lost time went.
`scripts/embedding_experiment.py` runs the comparison and writes the table and the plot.

[Note: embedding simulator model]
- Training: every committed step is one real step of the W workers (two-phase: run, then
  commit). ``Kill(step=k, stage=0, replica=w)`` kills worker ``w`` when the job first
  attempts step ``k``, before its commit: the attempt is abandoned everywhere (its
  compute is not even run -- nothing of it would be kept) and, after recovery, step ``k``
  is run again on the same data. A fault fires once.
- Time: a step costs ``step_s``; a failed attempt costs ``step_s`` (lost); a checkpoint
  (a consistent snapshot of every shard, dense replica and MFU counter) costs
  ``checkpoint_write_s`` every ``checkpoint_every`` committed steps, by default Daly's
  interval for the modelled MTBF (run time / failures); mirror traffic costs its bytes
  over ``transfer_bytes_per_s`` after every step (not overlapped: conservative).
- ``none``: no failures, no checkpoints -- the ideal.
- ``rollback``: every worker reloads the last checkpoint (``detect_s + replace_s +
  checkpoint_load_s``) and the steps since are redone (each ``step_s``, counted as lost).
- ``partial`` (CPR, and CPR with MFU mirrors): survivors keep their state; the dead
  worker's dense replica is copied from a live one, its shard is rebuilt by
  `restore_shard` from its mirror (if the ring successor holding it lives) and the
  checkpoint's shard part, freshest copy per row. Cost: ``detect_s + replace_s`` plus the
  transfer of the dense state and the shard over the bandwidth, plus
  ``checkpoint_load_s / W`` when rows come from the durable checkpoint. The dead worker's
  own mirror of its predecessor is re-seeded with a full copy. The planner (`recovery.planner.plan`, which applies `decide`)
  then accepts the restore or rolls the whole job back to the checkpoint.
- Exact strategies (``none``, ``rollback``, partial with ``mirror_every=1``) must end
  bit-identical to the no-failure run; `EmbeddingRunResult.digest` lets the experiment
  check it.
"""

from __future__ import annotations

from simulations.costs import EmbeddingTimeModel
from simulations.embedding_config import (
    RECOVERIES,
    EmbeddingSetup,
    EmbeddingStrategy,
    default_strategies,
    failure_schedule,
)
from simulations.embedding_loop import run_embedding
from simulations.embedding_results import (
    EmbeddingEvent,
    EmbeddingRunResult,
    plot_results,
    results_table,
)

# Re-exported so that ``simulations.embedding`` stays the one import of the simulator.
__all__ = [
    "RECOVERIES",
    "EmbeddingEvent",
    "EmbeddingRunResult",
    "EmbeddingSetup",
    "EmbeddingStrategy",
    "EmbeddingTimeModel",
    "default_strategies",
    "failure_schedule",
    "plot_results",
    "results_table",
    "run_embedding",
]
