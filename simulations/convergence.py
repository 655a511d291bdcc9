"""Convergence under stage failures, in one process: the CheckFree study.

One pipeline replica of a LLaMA-style model -- all ``S`` stage modules in this process,
the paper's setting -- is trained on real text while a failure process kills stages, and
each recovery strategy is charged its modelled wall-clock cost. The result is validation
loss against *simulated* wall-clock time, from which `time_to_target` and the experiment
tables are computed. `scripts/experiment.py` runs the matrix from a TOML file.

[Note: convergence simulator model]
- Training: microbatches run one after another through the stages in their route order
  (natural, or CheckFree+'s swapped routes on odd microbatches); gradients accumulate,
  the CheckFree+ shared (embedding / head) gradients are summed over their two holders,
  every stage clips to ``clip_grad_norm`` and records its clipped norm
  (`recovery.strategies.clip_stage_gradients`), then AdamW steps with linear warmup.
- Time: every attempted step costs ``step_s`` of simulated time (``redundant_factor``
  times that for redundant computation). Evaluation is free.
- Failures: in attempt ``j`` (one per attempted step, counted across rollbacks) stage
  ``s`` fails iff ``u[j, s] < p`` with ``p = 1 - (1 - h) ** (t_step / 3600)``, ``h`` the
  hourly rate per stage and ``t_step`` the strategy's step time. ``u`` is a pure function
  of ``(seed, j)``: common random numbers, so every strategy sees the same draws for the
  same seed (a slower strategy, with a larger ``p``, fails on a superset of attempts).
  A failure abandons the attempted step (its time is lost) except under redundant
  computation, where the neighbour's copy finishes it.
- Recovery, per strategy:
  ``none``: failures are not drawn.
  ``checkfree``: a lost intermediate stage is rebuilt from its neighbours
  (`recovery.strategies.rebuild_stage`), costing ``recovery_s``; a lost edge stage, or two
  adjacent lost stages, cannot be rebuilt, and the job rolls back to its last checkpoint
  (``checkpoint_every``, saved at ``checkpoint_write_s`` each; without checkpoints, to the
  initial weights). The published CheckFree protects intermediate stages only; the
  rollback is our stated choice for the rest.
  ``checkfree+``: swapped routes and (de)embedding replicas; edge stages are rebuilt by
  `recovery.strategies.edge_copy` at ``recovery_s``. Adjacent lost stages roll back as
  above when ``checkpoint_every`` is set, else the stage that cannot be averaged is
  re-initialised (rare: it needs two neighbouring failures in one step).
  ``checkpoint``: every ``checkpoint_every`` steps a checkpoint is saved
  (``checkpoint_write_s``); a failure rolls every stage and optimizer back to it, costs
  ``checkpoint_load_s``, and the steps since are redone.
  ``redundant``: no progress is lost; each failure costs ``failover_s``, and every step
  costs ``redundant_factor`` times as much.
- Exact strategies (``none``, ``checkpoint``, ``redundant``) never change *what* is
  trained, only *when*: a step re-run after a rollback uses the same data and the same
  arithmetic, so the weights after step ``k`` are bit-identical to a run without
  failures (tested). `run_convergence` can therefore take their losses from a
  no-failure ``baseline`` run and only replay the timeline, which makes the experiment
  matrix affordable; pass no baseline to train them literally.
"""

from __future__ import annotations

from simulations.convergence_config import KINDS, ConvergencePolicy, ConvergenceSetup
from simulations.convergence_loop import run_convergence
from simulations.convergence_results import (
    EvalRecord,
    FailureEvent,
    RunResult,
    auto_target,
    time_to_target,
)
from simulations.convergence_study import (
    ConvergenceExperiment,
    RunKey,
    display_rank,
    exact_sensitivity,
    steps_to_loss,
    summarize,
)
from simulations.costs import TimeModel
from simulations.failure_sources import (
    FailureProcess,
    FailureSource,
    ModelFailures,
    ScheduledFailures,
)
from simulations.pipeline import PipelineTrainer

# Re-exported so that ``simulations.convergence`` stays the one import of the simulator.
__all__ = [
    "KINDS",
    "ConvergenceExperiment",
    "ConvergencePolicy",
    "ConvergenceSetup",
    "EvalRecord",
    "FailureEvent",
    "FailureProcess",
    "FailureSource",
    "ModelFailures",
    "PipelineTrainer",
    "RunKey",
    "RunResult",
    "ScheduledFailures",
    "TimeModel",
    "auto_target",
    "display_rank",
    "exact_sensitivity",
    "run_convergence",
    "steps_to_loss",
    "summarize",
    "time_to_target",
]
