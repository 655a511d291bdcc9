"""The simulated recovery policies: what each does about a failure event and what it costs.

A :class:`PolicyModel` is a policy as the cluster simulator sees it (see ``[Note: simulator
model]`` in :mod:`simulations.cluster`): a snapshot schedule, the actions it may take
(each an :class:`ActionKind` with its downtime) and a vectorised rule choosing one per
event. A policy that is one recovery strategy of the hierarchy is named by its
`recovery.names.Strategy`; the others by a `simulations.policies.SimulatedPolicy`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from recovery.names import Strategy, Tier
from simulations.costs import CostModel, daly_interval, young_interval
from simulations.layout import Job, _pos_int
from simulations.policies import SimulatedPolicy

__all__ = [
    "CAUSES",
    "POLICY_MODELS",
    "ActionKind",
    "CheckFree",
    "CheckFreePlus",
    "CheckpointRestart",
    "EmbeddingPartial",
    "EventFacts",
    "PeerSnapshot",
    "Plan",
    "PolicyModel",
    "ReplicaCopy",
    "Schedule",
    "SimContext",
    "SnapshotPolicy",
    "make_policy_model",
]

CAUSES: tuple[str, ...] = (
    "detection",
    "replacement",
    "transfer",
    "lost_work",
    "checkpoint",
    "convergence",
    "exhausted",
)
"""Where lost time goes. ``replacement`` includes re-forming the process groups and, for
checkpoint-restart, the whole-job restart; ``transfer`` includes snapshot and checkpoint
loads; ``checkpoint`` is the time spent writing snapshots and checkpoints (kept or lost);
``exhausted`` is everything a fallback rollback costs (its stall and its lost work)."""

_ROLLBACK = str(Strategy.ROLLBACK)
_EFFECTS = ("stall", "approx", "partial", _ROLLBACK)
_TIERS = ("fast", "durable")
_EPS = 1e-9  # lattice slack, in periods: q within 1e-9 of a period of a lattice point is on it
_NO_DURABLE = float(2**40)  # "never": fast periods per durable checkpoint when there is none


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Where snapshots lie on the progress lattice (see ``[Note: simulator model]``).

    Raises:
        ValueError: for negative values, or a zero interval with a non-zero write cost
            (the job would do nothing but write).
    """

    work_s: float
    """Work between two fast snapshots, ``T1`` (0: snapshots are free and continuous)."""
    write_s: float
    """Blocking time of one fast snapshot, ``C1``."""
    durable_every: int
    """Fast periods per durable checkpoint, ``m`` (0: no durable tier -- a durable
    rollback restarts from the beginning)."""
    durable_write_s: float
    """Blocking time of one durable checkpoint, ``C2``."""
    label: str = ""
    """How the schedule was chosen, for tables."""

    def __post_init__(self) -> None:
        for name in ("work_s", "write_s", "durable_write_s"):
            value = getattr(self, name)
            if not value >= 0 or (math.isinf(value) and name != "work_s"):
                raise ValueError(f"Schedule.{name} must be >= 0 and finite, got {value!r}")
        if (
            isinstance(self.durable_every, bool)
            or not isinstance(self.durable_every, int)
            or self.durable_every < 0
        ):
            raise ValueError(
                f"Schedule.durable_every must be an integer >= 0, got {self.durable_every!r}"
            )
        if self.work_s == 0 and (self.write_s > 0 or self.durable_write_s > 0):
            raise ValueError(
                f"a snapshot interval of 0 s needs free writes, got write_s={self.write_s}, "
                f"durable_write_s={self.durable_write_s} (is step_s 0?)"
            )

    def params(self, horizon_s: float) -> tuple[float, float, float, float, bool]:
        """``(T1, K1, m, K2, continuous)`` with infinite intervals capped at the horizon."""
        t1 = min(self.work_s, 2.0 * horizon_s)
        if t1 == 0:
            return 0.0, 1.0, 1.0, 1.0, True
        k1 = t1 + self.write_s
        m = float(self.durable_every) if self.durable_every else _NO_DURABLE
        return t1, k1, m, m * k1 + self.durable_write_s, False


@dataclass(frozen=True, kw_only=True)
class ActionKind:
    """One thing a strategy may do about a failure, with its cost.

    Raises:
        ValueError: for an unknown effect, tier or cause, or a negative downtime.
    """

    name: str
    """Label in event logs and tables."""
    effect: str
    """What it does to progress: ``stall``, ``approx``, ``partial`` or ``rollback``."""
    downtime: Mapping[str, float]
    """Seconds of job-wide stall per cause; the phases run in :data:`CAUSES` order."""
    tier: str = "fast"
    """Snapshot tier a rollback (or the staleness of a partial restore) refers to."""
    loss_cause: str = "lost_work"
    """Cause that progress lost by this action is booked under."""

    def __post_init__(self) -> None:
        if self.effect not in _EFFECTS:
            raise ValueError(f"ActionKind.effect must be one of {_EFFECTS}, got {self.effect!r}")
        if self.tier not in _TIERS:
            raise ValueError(f"ActionKind.tier must be one of {_TIERS}, got {self.tier!r}")
        for cause, seconds in [*self.downtime.items(), (self.loss_cause, 0.0)]:
            if cause not in CAUSES:
                raise ValueError(f"unknown cause {cause!r}; causes are {CAUSES}")
            if not (seconds >= 0 and math.isfinite(seconds)):
                raise ValueError(f"downtime for {cause!r} must be >= 0 and finite, got {seconds!r}")

    @property
    def total_s(self) -> float:
        return float(sum(self.downtime.values()))


def _downtime(at_least: float = 0.0, **phases: float) -> dict[str, float]:
    """Phases in cause order; the last one is stretched so the total is >= ``at_least``."""
    phases = {k: v for k, v in phases.items() if v > 0} or {next(iter(phases)): 0.0}
    total = sum(phases.values())
    if total < at_least:
        last = next(reversed(phases))
        phases[last] += at_least - total
    return phases


@dataclass(frozen=True, kw_only=True, eq=False)
class EventFacts:
    """What a failure event left behind, under a strategy's recovery window.

    A stage group is *lost* when every replica of that stage is down (see
    :func:`exhaustion_probability` for when a worker counts as down).
    """

    lost_stages: np.ndarray
    """Stage groups this event left with no live replica."""
    adjacent: np.ndarray
    """Some lost group has a neighbouring group that is also entirely down."""
    edge: np.ndarray
    """A lost group is the first or the last stage."""
    tier_lost: np.ndarray
    """The event destroyed host memory whose snapshot copy was also down: the fast
    snapshot tier cannot restore every worker."""

    @classmethod
    def none(cls, n: int) -> EventFacts:
        """Facts for strategies that ignore them: nothing lost."""
        zeros = np.zeros(n, dtype=bool)
        return cls(
            lost_stages=np.zeros(n, dtype=np.int64), adjacent=zeros, edge=zeros, tier_lost=zeros
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class Plan:
    """A strategy's decision for every event: an action kind and its parameters."""

    kind: np.ndarray
    """Index into the policy's :meth:`PolicyModel.kinds`."""
    penalty_s: np.ndarray | None = None
    """``approx`` actions: progress lost (seconds of active time)."""
    keep: np.ndarray | None = None
    """``partial`` actions: fraction of the progress since the snapshot that is kept."""


@dataclass(frozen=True, kw_only=True)
class SimContext:
    """Everything a strategy may read to decide its costs."""

    job: Job
    costs: CostModel
    horizon_s: float
    job_mtbf_s: float
    """Mean time between failure events of the whole job (for checkpoint intervals)."""

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` of one replica's state into a worker, each GPU
        receiving its ``1 / (pp * tp)`` shard in parallel."""
        return self.costs.transfer_s(nbytes / (self.job.layout.pp * self.job.layout.tp))


class PolicyModel(ABC):
    """A simulated recovery policy: a snapshot schedule, the actions it may take, and a
    vectorised rule choosing one per failure event."""

    name: ClassVar[Strategy | SimulatedPolicy]
    """The strategy it is, or the policy label where it combines several."""
    strategy: ClassVar[Strategy]
    """The recovery strategy that sets it apart (what it does when no replica is left)."""
    exact: ClassVar[bool]
    """Exact strategies never change the model beyond what a failure-free run holds."""

    def down_window_s(self, ctx: SimContext) -> float | None:
        """How long a killed worker stays down (``None``: the strategy needs no facts)."""
        return None

    @abstractmethod
    def schedule(self, ctx: SimContext) -> Schedule:
        """The snapshot and checkpoint schedule."""

    @abstractmethod
    def kinds(self, ctx: SimContext) -> tuple[ActionKind, ...]:
        """The actions this strategy may take."""

    @abstractmethod
    def plan(self, facts: EventFacts, ctx: SimContext) -> Plan:
        """One action per event."""


@dataclass(frozen=True, kw_only=True)
class CheckpointRestart(PolicyModel):
    """The baseline: every failure restarts the whole job from the last durable checkpoint.

    Each failure costs detection, a whole-job restart, the checkpoint load and the work
    since the last checkpoint; every ``T`` of work costs a checkpoint write ``C``, with ``T``
    from Daly's (default) or Young's formula for the job MTBF, or given.

    Raises:
        ValueError: for a non-positive interval or an unknown formula.
    """

    name: ClassVar[Strategy | SimulatedPolicy] = SimulatedPolicy.CHECKPOINT_RESTART
    strategy: ClassVar[Strategy] = Strategy.RESTART
    exact: ClassVar[bool] = True
    interval_s: float | None = None
    """Work between checkpoints; ``None``: from ``formula``."""
    formula: str = "daly"
    """``daly`` or ``young``."""

    def __post_init__(self) -> None:
        if self.interval_s is not None and not self.interval_s > 0:
            raise ValueError(f"CheckpointRestart.interval_s must be > 0, got {self.interval_s!r}")
        if self.formula not in ("daly", "young"):
            raise ValueError(
                f"CheckpointRestart.formula must be 'daly' or 'young', got {self.formula!r}"
            )

    def schedule(self, ctx: SimContext) -> Schedule:
        c = ctx.costs.checkpoint_write_s
        if self.interval_s is not None:
            t, label = self.interval_s, "given"
        elif not math.isfinite(ctx.job_mtbf_s):
            t, label = math.inf, "no failures expected"
        else:
            rule = daly_interval if self.formula == "daly" else young_interval
            t, label = rule(c, ctx.job_mtbf_s), self.formula.capitalize()
        return Schedule(
            work_s=t,
            write_s=0.0,
            durable_every=1,
            durable_write_s=c,
            label=f"checkpoint every {t:,.0f} s ({label})",
        )

    def kinds(self, ctx: SimContext) -> tuple[ActionKind, ...]:
        c = ctx.costs
        down = _downtime(
            detection=c.detect_s, replacement=c.restart_s, transfer=c.checkpoint_load_s
        )
        return (ActionKind(name=Strategy.RESTART, effect=_ROLLBACK, tier="durable", downtime=down),)

    def plan(self, facts: EventFacts, ctx: SimContext) -> Plan:
        return Plan(kind=np.zeros(len(facts.lost_stages), dtype=np.int64))


@dataclass(frozen=True, kw_only=True)
class SnapshotPolicy:
    """The rollback tiers behind a peer-based strategy.

    Raises:
        ValueError: for a non-positive interval.
    """

    every_steps: int | None = 50
    """Steps between in-memory snapshots (``None``: no fast tier; rollbacks go to the
    durable checkpoint)."""
    durable_every_s: float | None = 3 * 3600.0
    """Work between durable checkpoints (``None``: none; a durable rollback loses
    everything). Three hours: peers absorb single failures, so the durable tier only has
    to cover disasters, as in Gemini."""

    def __post_init__(self) -> None:
        if self.every_steps is not None:
            _pos_int("SnapshotPolicy.every_steps", self.every_steps)
        if self.durable_every_s is not None and not (
            self.durable_every_s > 0 and math.isfinite(self.durable_every_s)
        ):
            raise ValueError(
                f"SnapshotPolicy.durable_every_s must be > 0, got {self.durable_every_s!r}"
            )


@dataclass(frozen=True, kw_only=True)
class _PeerPolicy(PolicyModel):
    """Shared parts of the strategies that replace only the dead workers."""

    snapshots: SnapshotPolicy = field(default_factory=SnapshotPolicy)
    warm_spares: bool = True
    """Replacements come from a pool of warm spares (``replace_warm_s``), else cold
    (``replace_s``)."""

    def schedule(self, ctx: SimContext) -> Schedule:
        c, p = ctx.costs, self.snapshots
        durable = p.durable_every_s
        if p.every_steps is None:
            t = durable if durable is not None else math.inf
            return Schedule(
                work_s=t,
                write_s=0.0,
                durable_every=1,
                durable_write_s=c.checkpoint_write_s if durable else 0.0,
                label=f"checkpoint every {t:,.0f} s" if durable else "no snapshots or checkpoints",
            )
        t1 = p.every_steps * c.step_s
        m = 0 if durable is None else max(1, round(durable / t1)) if t1 > 0 else 1
        label = f"snapshot every {p.every_steps} steps" + (
            f", checkpoint every {m * t1:,.0f} s" if m else ", no checkpoints"
        )
        return Schedule(
            work_s=t1,
            write_s=c.snapshot_write_s,
            durable_every=m,
            durable_write_s=c.checkpoint_write_s if m else 0.0,
            label=label,
        )

    def _replace_s(self, ctx: SimContext) -> float:
        c = ctx.costs
        return (c.replace_warm_s if self.warm_spares else c.replace_s) + c.reform_s

    def _copy(self, ctx: SimContext) -> ActionKind:
        c = ctx.costs
        down = _downtime(
            detection=c.detect_s,
            replacement=self._replace_s(ctx),
            transfer=ctx.transfer_s(c.model_state_bytes),
        )
        return ActionKind(name=Strategy.REPLICA_COPY, effect="stall", downtime=down)

    def _fast_load_s(self, ctx: SimContext) -> float:
        return (
            ctx.costs.snapshot_load_s
            if self.snapshots.every_steps is not None
            else ctx.costs.checkpoint_load_s
        )

    def _fallbacks(
        self, ctx: SimContext, at_least: float, cause: str = "exhausted"
    ) -> tuple[ActionKind, ActionKind]:
        c = ctx.costs
        base = c.detect_s + self._replace_s(ctx)
        fast = max(base + self._fast_load_s(ctx), at_least)
        durable = max(base + c.checkpoint_load_s, fast)
        return (
            ActionKind(
                name=f"fallback_{Strategy.ROLLBACK}",
                effect=_ROLLBACK,
                tier="fast",
                downtime={cause: fast},
                loss_cause=cause,
            ),
            ActionKind(
                name=f"fallback_{Tier.DURABLE}",
                effect=_ROLLBACK,
                tier="durable",
                downtime={cause: durable},
                loss_cause=cause,
            ),
        )

    def down_window_s(self, ctx: SimContext) -> float | None:
        return self._copy(ctx).total_s


@dataclass(frozen=True, kw_only=True)
class PeerSnapshot(_PeerPolicy):
    """Gemini-style: every failure rolls every worker back to the last in-memory snapshot
    (fast reload); the durable checkpoint only when the snapshot tier itself is lost."""

    name: ClassVar[Strategy | SimulatedPolicy] = SimulatedPolicy.PEER_SNAPSHOT
    strategy: ClassVar[Strategy] = Strategy.ROLLBACK
    exact: ClassVar[bool] = True

    def kinds(self, ctx: SimContext) -> tuple[ActionKind, ...]:
        c = ctx.costs
        down = _downtime(
            detection=c.detect_s, replacement=self._replace_s(ctx), transfer=self._fast_load_s(ctx)
        )
        rollback = ActionKind(name=Strategy.ROLLBACK, effect=_ROLLBACK, tier="fast", downtime=down)
        return rollback, self._fallbacks(ctx, rollback.total_s)[1]

    def down_window_s(self, ctx: SimContext) -> float | None:
        return self.kinds(ctx)[0].total_s

    def plan(self, facts: EventFacts, ctx: SimContext) -> Plan:
        return Plan(kind=facts.tier_lost.astype(np.int64))


@dataclass(frozen=True, kw_only=True)
class ReplicaCopy(_PeerPolicy):
    """Oobleck/torchft-style: a replacement copies the state of a live replica of its
    stage (exact, no lost work); when none is alive, roll back."""

    name: ClassVar[Strategy | SimulatedPolicy] = Strategy.REPLICA_COPY
    strategy: ClassVar[Strategy] = Strategy.REPLICA_COPY
    exact: ClassVar[bool] = True

    def kinds(self, ctx: SimContext) -> tuple[ActionKind, ...]:
        copy = self._copy(ctx)
        return (copy, *self._fallbacks(ctx, copy.total_s))

    def plan(self, facts: EventFacts, ctx: SimContext) -> Plan:
        kind = np.where(facts.lost_stages > 0, np.where(facts.tier_lost, 2, 1), 0)
        return Plan(kind=kind)


@dataclass(frozen=True, kw_only=True)
class CheckFree(_PeerPolicy):
    """CheckFree: replica copy while a replica lives; a lost stage group is rebuilt as the
    gradient-norm-weighted average of its neighbours (approximate, with a convergence
    penalty); the first and last stage, or two adjacent lost groups, fall back to rollback."""

    name: ClassVar[Strategy | SimulatedPolicy] = SimulatedPolicy.CHECKFREE
    strategy: ClassVar[Strategy] = Strategy.NEIGHBOR_AVERAGE
    exact: ClassVar[bool] = False
    handles_edges: ClassVar[bool] = False

    def kinds(self, ctx: SimContext) -> tuple[ActionKind, ...]:
        c = ctx.costs
        copy = self._copy(ctx)
        down = _downtime(
            copy.total_s,
            detection=c.detect_s,
            replacement=self._replace_s(ctx),
            transfer=ctx.transfer_s(2.0 * c.model_weight_bytes),
        )
        approx = ActionKind(
            name="approximate", effect="approx", downtime=down, loss_cause="convergence"
        )
        fast_fb, durable_fb = self._fallbacks(ctx, approx.total_s)
        approx_durable = replace(approx, name="approximate_durable", tier="durable")
        return copy, approx, approx_durable, fast_fb, durable_fb

    def plan(self, facts: EventFacts, ctx: SimContext) -> Plan:
        stages = ctx.job.layout.pp
        lost = facts.lost_stages > 0
        if self.handles_edges:
            blocked = facts.adjacent | (stages < 2)
        else:
            blocked = facts.adjacent | facts.edge
        tier = facts.tier_lost.astype(np.int64)
        kind = np.where(~lost, 0, np.where(blocked, 3 + tier, 1 + tier))
        penalty = facts.lost_stages * (ctx.costs.approx_penalty_steps * ctx.costs.step_s)
        return Plan(kind=kind, penalty_s=penalty.astype(np.float64))


@dataclass(frozen=True, kw_only=True)
class CheckFreePlus(CheckFree):
    """CheckFree+: as CheckFree, and a lost first or last stage is copied from its swap
    partner (out-of-order pipelining), with the (de)embedding from the neighbour's copy."""

    name: ClassVar[Strategy | SimulatedPolicy] = SimulatedPolicy.CHECKFREE_PLUS
    strategy: ClassVar[Strategy] = Strategy.EDGE_COPY
    handles_edges: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class EmbeddingPartial(_PeerPolicy):
    """CPR-style partial recovery: replica copy while a replica lives; a lost group's
    state is restored stale from its last snapshot while every other worker keeps its
    current state (no rollback); penalty proportional to the lost updates (PLS).

    Meant for embedding-dominated (recommendation) jobs, where each worker holds shards
    of sparse tables; for dense models stale layers cost more than the PLS proxy says."""

    name: ClassVar[Strategy | SimulatedPolicy] = Strategy.EMBEDDING_PARTIAL
    strategy: ClassVar[Strategy] = Strategy.EMBEDDING_PARTIAL
    exact: ClassVar[bool] = False

    def kinds(self, ctx: SimContext) -> tuple[ActionKind, ...]:
        c = ctx.costs
        copy = self._copy(ctx)
        fast = _downtime(
            copy.total_s,
            detection=c.detect_s,
            replacement=self._replace_s(ctx),
            transfer=self._fast_load_s(ctx),
        )
        partial = ActionKind(
            name="partial_restore", effect="partial", downtime=fast, loss_cause="convergence"
        )
        floor = partial.total_s
        durable = _downtime(
            floor,
            detection=c.detect_s,
            replacement=self._replace_s(ctx),
            transfer=c.checkpoint_load_s,
        )
        partial_durable = ActionKind(
            name="partial_durable",
            effect="partial",
            tier="durable",
            downtime=durable,
            loss_cause="convergence",
        )
        return copy, partial, partial_durable

    def plan(self, facts: EventFacts, ctx: SimContext) -> Plan:
        share = facts.lost_stages / ctx.job.layout.pp
        keep = np.clip(1.0 - ctx.costs.pls_penalty_scale * share, 0.0, 1.0)
        kind = np.where(facts.lost_stages > 0, 1 + facts.tier_lost.astype(np.int64), 0)
        return Plan(kind=kind, keep=keep)


POLICY_MODELS: dict[str, type[PolicyModel]] = {
    cls.name: cls
    for cls in (
        CheckpointRestart,
        PeerSnapshot,
        ReplicaCopy,
        CheckFree,
        CheckFreePlus,
        EmbeddingPartial,
    )
}
"""Every built-in policy model by name (a `Strategy` or `SimulatedPolicy` member), in
table order."""


def make_policy_model(name: str, **options: Any) -> PolicyModel:
    """Build a built-in policy model by name (a key of `POLICY_MODELS`).

    Raises:
        ValueError: for an unknown name or option.
    """
    if name not in POLICY_MODELS:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(POLICY_MODELS)}")
    try:
        return POLICY_MODELS[name](**options)
    except TypeError as err:
        raise ValueError(f"bad options for strategy {name!r}: {err}") from err
