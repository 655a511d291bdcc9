"""The executor: turns a `RecoveryPlan` into state transfers between workers.

One small function per strategy, keyed by `Strategy`. A per-action strategy returns the
calls it started (a send on each source, a receive on each target); the executor starts
every strategy's calls before it waits for any, because a source may be sending to one
target while another target receives from a third worker over the same process group.
Rollback and the restart baseline restore every worker and have a function of their own.
The executor decides nothing: what moves where is the planner's. Every receive checks
what arrived against the sender's digests (see [Note: checked transfers] in
recovery/transport/process_group.py); a corrupted arrival is never used: `execute` raises
`TransferCorrupted` once every call has returned, and `execute_or_fall_back` books the
source (or the snapshot copy) as untrusted and carries out the plan made without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.errors import RedundancyExhausted, SnapshotCorrupted, TransferCorrupted
from recovery.groups.group import Call, WorkerGroup, require
from recovery.names import Strategy, Tier
from recovery.planner import RecoveryAction, RecoveryPlan
from recovery.policy import RecoveryPolicy
from recovery.runtime.detection import settle
from recovery.runtime.ledger import RedundancyLedger
from recovery.snapshots import DurableStore
from recovery.worker import StageWorker

__all__ = ["Restore", "execute", "execute_or_fall_back"]

log = logging.getLogger("checkfree")

Transfers = dict[tuple[int, str], Call]
"""(rank, what) -> the call: ``send*`` and ``named*`` calls return bytes sent, ``copy``
calls ``(step, bytes received, corruption)``, ``rebuild`` calls ``(bytes, corruption)``,
a rollback's ``own`` and ``recv`` calls ``(step, corruption)`` (see `Corruption`)."""

_RECEIVES = ("copy", "rebuild", "own", "recv")
"""The calls that receive state; the last item of each one's result is its `Corruption`."""


@dataclass
class Restore:
    """What the executor works with."""

    group: WorkerGroup
    topology: Topology
    spec: TrainSpec
    policy: RecoveryPolicy
    ledger: RedundancyLedger
    timeout: timedelta
    """For each transfer (and load) to finish."""
    durable: DurableStore | None = None
    snapshot_dir: str | None = None
    checkpoint_dir: str = ""
    generation: int | None = None
    """The generation the transfers run in (what an abort at a failure names)."""


def _replica_copy(ctx: Restore, actions: Sequence[RecoveryAction], step: int) -> Transfers:
    """Each source sends its full state to the targets it serves (one send, many receivers)."""
    by_source: dict[int, list[int]] = {}
    for action in actions:
        by_source.setdefault(action.sources[0], []).append(action.rank)
    calls: Transfers = {}
    for src, dsts in by_source.items():
        calls[(src, "send")] = ctx.group.submit(src, StageWorker.send_state, dsts)
        for dst in dsts:
            calls[(dst, "copy")] = ctx.group.submit(dst, StageWorker.recv_state, src)
    return calls


def _left_out(ctx: Restore, actions: Sequence[RecoveryAction], step: int) -> Transfers:
    """A shrink: the workers it leaves out get nothing (see recovery/runtime/elastic.py)."""
    return {}


def _from_mirror(ctx: Restore, actions: Sequence[RecoveryAction], step: int) -> Transfers:
    """The mirror holder sends the shard it mirrors (restored exact, or partially stale)."""
    calls: Transfers = {}
    for action in actions:
        (holder,) = action.sources
        calls[(holder, f"send{action.rank}")] = ctx.group.submit(
            holder, StageWorker.send_mirror, action.rank
        )
        calls[(action.rank, "copy")] = ctx.group.submit(action.rank, StageWorker.recv_shard, holder)
    return calls


def _rebuild(ctx: Restore, actions: Sequence[RecoveryAction], step: int) -> Transfers:
    """CheckFree(+): the neighbours send their named state; the target rebuilds from it."""
    calls: Transfers = {}
    config = ctx.policy.checkfree
    moments = not config.reset_optimizer or ctx.spec.shared_params is not None
    norms = ctx.ledger.grad_norms
    for action in actions:
        stage = ctx.topology.worker(action.rank).stage
        if action.strategy == Strategy.NEIGHBOR_AVERAGE:
            roles = {"prev": action.sources[0], "next": action.sources[1]}
        else:  # edge_copy: stage 0 copies stage 1 (its next), stage S-1 copies S-2 (its prev)
            roles = {"next" if stage == 0 else "prev": action.sources[0]}
        for role, src in roles.items():
            calls[(src, f"named{action.rank}{role}")] = ctx.group.submit(
                src, StageWorker.send_named_state, action.rank, moments
            )
        calls[(action.rank, "rebuild")] = ctx.group.submit(
            action.rank,
            StageWorker.rebuild,
            action.strategy,
            roles,
            norms.neighbours(stage),
            config,
            step,
        )
    return calls


PER_ACTION: dict[Strategy, Callable[[Restore, Sequence[RecoveryAction], int], Transfers]] = {
    Strategy.REPLICA_COPY: _replica_copy,
    Strategy.REPLICA_VOTE: _replica_copy,
    Strategy.GROW: _replica_copy,
    Strategy.SHRINK: _left_out,
    Strategy.SHARD_MIRROR: _from_mirror,
    Strategy.EMBEDDING_PARTIAL: _from_mirror,
    Strategy.NEIGHBOR_AVERAGE: _rebuild,
    Strategy.EDGE_COPY: _rebuild,
}
"""The strategies that rebuild single workers from live ones."""


def _gather(ctx: Restore, calls: Transfers, what: str) -> dict[tuple[int, str], Any]:
    """Wait for a plan's transfers; the first to fail aborts the rest (see `settle`)."""
    got = settle(ctx.group, calls, ctx.timeout, generation=ctx.generation)
    return dict(require(got, what).results)


def _sent(results: dict[tuple[int, str], Any]) -> int:
    return sum(int(v) for k, v in results.items() if k[1].startswith(("send", "named")))


def _refuse_corrupted(
    ctx: Restore,
    results: dict[tuple[int, str], Any],
    snapshot: int | None = None,
    copies: dict[int, int] | None = None,
) -> None:
    """Raise `TransferCorrupted` if some receive found what arrived corrupted. ``copies``:
    the targets that received another replica's snapshot, and whose (the copy that is
    corrupted, which `TransferCorrupted.found` names as its target)."""
    copies = copies or {}
    found = [
        (copies.get(rank, rank), int(source), tuple(tensors))
        for (rank, what), value in sorted(results.items(), key=str)
        if what in _RECEIVES
        for source, tensors in sorted(value[-1].items())
    ]
    if not found:
        return
    worker = ctx.topology.worker
    what = "state" if snapshot is None else f"the peer snapshot of step {snapshot}"
    lines = [
        f"{what} from worker {worker(src)} (rank {src}) to worker {worker(dst)} (rank {dst}) "
        f"arrived corrupted in {', '.join(tensors)}"
        for dst, src, tensors in found
    ]
    raise TransferCorrupted("; ".join(lines), found=found, snapshot=snapshot)


def _rollback(ctx: Restore, plan: RecoveryPlan) -> int:
    """Every worker restores the plan's snapshot: its own copy, a holder's, or the durable tier."""
    step = plan.resume_step
    moved = 0
    if plan.tier == Tier.DURABLE:
        loaded = ctx.group.call(
            StageWorker.durable_load,
            args=lambda rank: (ctx.snapshot_dir, step),
            timeout=ctx.policy.timeouts.save,
        )
        require(loaded, f"load the durable snapshot of step {step}")
    else:
        calls: Transfers = {}
        for action in plan.actions:
            if not action.sources:
                calls[(action.rank, "own")] = ctx.group.submit(
                    action.rank, StageWorker.restore_own, step
                )
                continue
            (holder,) = action.sources
            copy = action.rank if action.copy_of is None else action.copy_of
            calls[(holder, f"send{action.rank}")] = ctx.group.submit(
                holder, StageWorker.send_snapshot, step, copy, action.rank
            )
            calls[(action.rank, "recv")] = ctx.group.submit(
                action.rank, StageWorker.recv_snapshot, step, holder
            )
        results = _gather(ctx, calls, f"roll back to step {step}")
        copies = {a.rank: a.copy_of for a in plan.actions if a.copy_of is not None}
        _refuse_corrupted(ctx, results, snapshot=step, copies=copies)
        moved = _sent(results)
    if ctx.durable is not None:
        ctx.durable.discard_after(step)
    ctx.ledger.rolled_back(step)
    return moved


def _restart(ctx: Restore, plan: RecoveryPlan) -> int:
    """The baseline: every (new, cold) worker loads the last checkpoint, if there is one."""
    if plan.resume_step > 0:
        loaded = ctx.group.call(
            StageWorker.load_checkpoint,
            args=lambda rank: (ctx.checkpoint_dir, plan.resume_step),
            timeout=ctx.timeout,
        )
        require(loaded, f"load the checkpoint of step {plan.resume_step}")
    return 0


WHOLE_PLAN: dict[Strategy, Callable[[Restore, RecoveryPlan], int]] = {
    Strategy.ROLLBACK: _rollback,
    Strategy.RESTART: _restart,
}
"""The strategies that restore every worker."""


def execute_or_fall_back(
    ctx: Restore, plan: RecoveryPlan, replan: Callable[[], RecoveryPlan]
) -> tuple[RecoveryPlan, int]:
    """`execute` ``plan``; if the durable snapshot it loads is corrupted, book that snapshot
    as gone and carry out ``replan()`` instead (an older snapshot); if some state arrived
    corrupted, book its source (or the snapshot copy) as untrusted and carry out
    ``replan()`` -- another live replica, or the next tier of the recovery hierarchy.
    Returns the plan carried out and the bytes moved.

    Raises:
        RecoveryInterrupted: naming the workers lost or broken while transferring.
        RedundancyExhausted: from ``replan``, when no intact snapshot or trusted source is
            left (naming the worker and the tensors that arrived corrupted).
    """
    while True:
        try:
            return plan, execute(ctx, plan)
        except SnapshotCorrupted as exc:  # never load it; fall back to an older snapshot
            log.warning("durable snapshot of step %d is corrupted: %s", plan.resume_step, exc)
            ctx.ledger.durable_steps.remove(plan.resume_step)
            plan = replan()
        except TransferCorrupted as exc:  # never use it; plan again without that source
            log.warning("%s: planning again without it", exc)
            ctx.ledger.distrust(exc.found, exc.snapshot)
            try:
                plan = replan()
            except RedundancyExhausted as gone:
                raise RedundancyExhausted(f"{exc}, and no other source is left: {gone}") from None


def execute(ctx: Restore, plan: RecoveryPlan) -> int:
    """Carry out ``plan``'s state movements. Returns the bytes moved.

    Raises:
        RecoveryInterrupted: naming the workers lost or broken while transferring.
        SnapshotCorrupted: if a durable snapshot chosen by the plan fails its checksums
            (nothing was loaded from it).
        TransferCorrupted: if some state arrived corrupted (it is not used; ``snapshot`` is
            the step of a peer snapshot that did, None for a live worker's state).
    """
    kinds = {a.strategy for a in plan.actions}
    whole = [WHOLE_PLAN[k] for k in kinds if k in WHOLE_PLAN]
    if whole:
        assert len(kinds) == 1, f"planner invariant: {kinds} restore everyone alone"
        return whole[0](ctx, plan)
    calls: Transfers = {}
    # In PER_ACTION's order, as a worker runs its calls in the order they were started.
    for fn in dict.fromkeys(PER_ACTION.values()):
        actions = [a for a in plan.actions if PER_ACTION[a.strategy] is fn]
        if actions:
            calls.update(fn(ctx, actions, plan.resume_step))
    results = _gather(ctx, calls, "transfer state")
    _refuse_corrupted(ctx, results)
    steps = {v[0] for k, v in results.items() if k[1] == "copy"}
    assert steps <= {plan.resume_step}, (steps, plan.resume_step)
    for action in plan.actions:  # a rebuilt stage has no gradient history yet
        if PER_ACTION[action.strategy] is _rebuild:
            ctx.ledger.forget_norm(ctx.topology.worker(action.rank).stage)
    return _sent(results)
