"""The failure-and-recovery loop of the convergence simulator: `run_convergence`.

See [Note: convergence simulator model] in `simulations.convergence`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from parallelism.topology import Topology
from parallelism.workloads.llama import (
    edge_partner,
)
from recovery.errors import RedundancyExhausted
from recovery.names import APPROXIMATE, Strategy
from recovery.planner import RecoveryPlan, Redundancy, plan
from recovery.policy import RecoveryPolicy, SnapshotPolicy
from recovery.strategies.checkfree import (
    CheckFreeConfig,
)
from simulations.convergence_config import (
    ConvergencePolicy,
    ConvergenceSetup,
    _fields,
    _positive_int,
)
from simulations.convergence_results import (
    EvalRecord,
    FailureEvent,
    RunResult,
)
from simulations.costs import TimeModel
from simulations.failure_sources import FailureSource
from simulations.pipeline import PipelineTrainer
from simulations.policies import SimulatedPolicy

__all__ = ["run_convergence"]


# ---- the failure-and-recovery loop ------------------------------------------------------------


class _Executor(Protocol):
    def train(self, step: int) -> float | None: ...
    def evaluate(self, step: int) -> float: ...
    def snapshot(self) -> Any: ...
    def restore(self, snapshot: Any) -> None: ...
    def rebuild(self, lost: Sequence[int], step: int, attempt: int) -> list[str]: ...
    def reinit(self, stage: int, attempt: int, partner_lost: bool) -> None: ...


class _Live:
    """Executes the loop's decisions on a real `PipelineTrainer`."""

    def __init__(self, trainer: PipelineTrainer, config: CheckFreeConfig) -> None:
        self.trainer = trainer
        self.config = config

    def train(self, step: int) -> float | None:
        return self.trainer.train_step(step)

    def evaluate(self, step: int) -> float:
        return self.trainer.evaluate()

    def snapshot(self) -> Any:
        return self.trainer.snapshot()

    def restore(self, snapshot: Any) -> None:
        self.trainer.restore(snapshot)

    def rebuild(self, lost: Sequence[int], step: int, attempt: int) -> list[str]:
        return self.trainer.rebuild(lost, self.config, step=step, attempt=attempt)

    def reinit(self, stage: int, attempt: int, partner_lost: bool) -> None:
        self.trainer.reinit(stage, attempt=attempt, partner_lost=partner_lost)


class _Replay:
    """Replays an exact strategy on a no-failure baseline: the loss at step k is the
    baseline's (see [Note: convergence simulator model])."""

    def __init__(self, baseline: RunResult) -> None:
        self.losses = {r.step: r.val_loss for r in baseline.records}

    def train(self, step: int) -> float | None:
        return None

    def evaluate(self, step: int) -> float:
        if step not in self.losses:
            raise ValueError(
                f"the baseline run has no evaluation at step {step}; run it with the same "
                "steps and eval_every"
            )
        return self.losses[step]

    def snapshot(self) -> Any:
        return None

    def restore(self, snapshot: Any) -> None:
        return None

    def rebuild(self, lost: Sequence[int], step: int, attempt: int) -> list[str]:
        raise AssertionError("exact strategies never rebuild")

    def reinit(self, stage: int, attempt: int, partner_lost: bool) -> None:
        raise AssertionError("exact strategies never re-initialise")


def run_convergence(
    setup: ConvergenceSetup,
    strategy: ConvergencePolicy,
    failures: FailureSource,
    times: TimeModel,
    *,
    steps: int,
    eval_every: int = 25,
    baseline: RunResult | None = None,
    progress: Callable[[int], None] | None = None,
    max_attempts: int | None = None,
) -> RunResult:
    """Train under ``failures`` with ``strategy`` for ``steps`` committed steps.

    See [Note: convergence simulator model]. Validation loss is recorded at step 0 and
    every ``eval_every`` committed steps (and at the end), with the simulated time.
    ``baseline`` (a ``none`` run of the same setup, steps and eval_every) lets an exact
    strategy replay the timeline without training. ``progress(step)`` is called after each
    committed step.

    Raises:
        ValueError: for a non-positive ``steps`` / ``eval_every``, a ``checkfree+`` run with
            fewer than 4 stages, or a baseline that does not match.

    A run that has not finished after ``max_attempts`` attempted steps (default
    ``20 * steps``) -- failures outpace progress, e.g. rollbacks every few steps -- stops
    there with ``info["finished"] = False``; its loss may never reach a target.
    """
    _positive_int("run_convergence", "steps", steps)
    _positive_int("run_convergence", "eval_every", eval_every)
    max_attempts = 20 * steps if max_attempts is None else max_attempts
    threads = torch.get_num_threads()
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)
    try:
        executor: _Executor
        derived = baseline is not None and strategy.exact
        if derived:
            assert baseline is not None
            if baseline.steps != steps or baseline.strategy != SimulatedPolicy.NONE:
                raise ValueError(
                    f"baseline must be a 'none' run of {steps} steps, got "
                    f"{baseline.strategy!r} with {baseline.steps}"
                )
            executor = _Replay(baseline)
        else:
            trainer = PipelineTrainer(setup, plus=strategy.plus, swap_every=strategy.swap_every)
            executor = _Live(trainer, strategy.checkfree)
        return _drive(
            setup,
            strategy,
            failures,
            times,
            executor,
            steps,
            eval_every,
            progress,
            max_attempts,
            derived=derived,
        )
    finally:
        torch.set_num_threads(threads)


def _drive(
    setup: ConvergenceSetup,
    strategy: ConvergencePolicy,
    failures: FailureSource,
    times: TimeModel,
    ex: _Executor,
    steps: int,
    eval_every: int,
    progress: Callable[[int], None] | None,
    max_attempts: int,
    *,
    derived: bool,
) -> RunResult:
    S = setup.stages
    step_s = times.step_time(strategy)
    result = RunResult(
        strategy=strategy.name,
        rate=failures.hourly_rate if strategy.kind != SimulatedPolicy.NONE else 0.0,
        seed=failures.seed,
        steps=steps,
        step_s=step_s,
        derived=derived,
        info={
            "strategy": strategy.to_dict(),
            "p_step": failures.probability(step_s),
            "setup": {**_fields(setup), "overrides": dict(setup.overrides)},
            "times": _fields(times),
            "eval_every": eval_every,
        },
    )
    every = strategy.checkpoint_every
    now = 0.0
    step = 0
    saved_step = 0
    # CheckFree keeps the initial weights to roll back to (see the Note); CheckFree+
    # without checkpoints has nothing to roll back to.
    has_saved = every is not None or strategy.kind == SimulatedPolicy.CHECKFREE
    saved = ex.snapshot() if has_saved else None
    train_losses: dict[int, float] = {}
    result.records.append(EvalRecord(step=0, time_s=0.0, val_loss=ex.evaluate(0)))
    attempt = 0
    while step < steps:
        if attempt >= max_attempts:
            # Failures outpace progress (rollbacks every few steps): stop and say so.
            result.info["finished"] = False
            result.info["reached_step"] = step
            break
        lost = [] if strategy.kind == SimulatedPolicy.NONE else failures.failed(attempt, S, step_s)
        this_attempt = attempt
        attempt += 1
        now += step_s
        if lost:
            attempted = step
            action, cost, lost_steps = _recover(
                strategy, times, ex, lost, S, step, this_attempt, saved_step if has_saved else None
            )
            if action == Strategy.ROLLBACK:
                ex.restore(saved)
                step = saved_step
            now += cost
            result.events.append(
                FailureEvent(
                    attempt=this_attempt,
                    step=attempted,
                    time_s=now,
                    stages=tuple(lost),
                    action=action,
                    lost_steps=lost_steps,
                    seconds=cost,
                )
            )
            if action != _FAILOVER:
                continue  # the attempted step was abandoned; it is re-run
        loss = ex.train(step)
        if loss is not None:
            train_losses[step] = loss
        step += 1
        if progress is not None:
            progress(step)
        if every is not None and step % every == 0:
            saved = ex.snapshot()
            saved_step = step
            now += times.checkpoint_write_s
        if step % eval_every == 0 or step == steps:
            result.records.append(EvalRecord(step=step, time_s=now, val_loss=ex.evaluate(step)))
    result.info.setdefault("finished", True)
    result.total_time_s = now
    result.attempts = attempt
    result.train_losses = [train_losses[k] for k in sorted(train_losses)]
    return result


_FAILOVER = "failover"
"""Redundant computation's action: the neighbour's copy finishes the step (nothing is lost,
so there is nothing to plan)."""
_REINIT = "reinit"

_POLICIES = {
    SimulatedPolicy.CHECKFREE: RecoveryPolicy(
        approximate="checkfree", snapshots=SnapshotPolicy(peer_every=None)
    ),
    SimulatedPolicy.CHECKFREE_PLUS: RecoveryPolicy(
        approximate="checkfree+", snapshots=SnapshotPolicy(peer_every=None)
    ),
    SimulatedPolicy.CHECKPOINT: RecoveryPolicy(
        exact_only=True, snapshots=SnapshotPolicy(peer_every=None)
    ),
}
"""The runtime policy each simulated policy is: the planner decides for both."""


def _plan(
    strategy: ConvergencePolicy, lost: list[int], num_stages: int, step: int, saved: int | None
) -> RecoveryPlan:
    """The planner's decision for one pipeline replica (one worker per stage) that lost the
    ``lost`` stages at ``step``; ``saved`` is the step of the last checkpoint (None: none).

    Raises:
        RedundancyExhausted: if some stage has no source and there is no checkpoint.
    """
    topology = Topology(stages=num_stages, replicas=1)
    gone = set(lost)
    redundancy = Redundancy(
        alive={s: step for s in range(num_stages) if s not in gone},
        durable_steps=() if saved is None else (saved,),
    )
    return plan(topology, gone, redundancy, _POLICIES[strategy.kind])


def _recover(
    strategy: ConvergencePolicy,
    times: TimeModel,
    ex: _Executor,
    lost: list[int],
    num_stages: int,
    step: int,
    attempt: int,
    saved_step: int | None,
) -> tuple[str, float, int]:
    """Carry out what the planner decides about ``lost``: (action, seconds, committed
    steps undone). ``saved_step`` is the step of the last checkpoint (None: none)."""
    if strategy.kind == SimulatedPolicy.REDUNDANT:
        return _FAILOVER, times.failover_s, 0
    try:
        decision = _plan(strategy, lost, num_stages, step, saved_step)
    except RedundancyExhausted:
        # CheckFree+ without checkpoints and adjacent failures: rebuild what can be
        # rebuilt, re-initialise the rest (see the Note).
        methods = []
        lost_set = set(lost)
        for s in sorted(lost):
            if s - 1 in lost_set or s + 1 in lost_set:
                partner = edge_partner(s, num_stages)
                ex.reinit(s, attempt, partner is not None and partner in lost_set)
                methods.append(_REINIT)
        rest = [s for s in lost if not (s - 1 in lost_set or s + 1 in lost_set)]
        if rest:
            methods += ex.rebuild(rest, step, attempt)
        return ",".join(dict.fromkeys(methods)), times.recovery_s, 0
    if decision.tier is not None:
        assert all(a.strategy == Strategy.ROLLBACK for a in decision.actions)
        return Strategy.ROLLBACK, times.checkpoint_load_s, step - decision.resume_step
    assert {a.strategy for a in decision.actions} <= APPROXIMATE, decision
    # The rebuild is the planner's neighbour_average / edge_copy, done with the trainer's
    # states (it reports the method per stage: an ablation may average differently).
    methods = ex.rebuild(lost, step, attempt)
    return ",".join(dict.fromkeys(methods)), times.recovery_s, 0
