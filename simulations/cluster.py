"""Cluster-scale failure simulation: which recovery strategy gives the most training per hour.

Extrapolates measured recovery costs (:class:`~simulations.costs.CostModel`) to a job of any
size, under any failure model (:mod:`simulations.traces`), for every recovery strategy at
once, over many Monte Carlo seeds; reports goodput with confidence intervals, the time
lost per cause, and every failure with the action taken. Pure numpy; the per-event
recurrence runs once for all strategies and seeds together, so 100 seeds of a 54-day,
16,384-GPU job take well under a second.

[Note: simulator model]

Job. ``gpus = pp * dp * tp``. A *worker* is one pipeline stage of one replica: ``tp`` GPUs
that die together (any of its GPUs failing kills the worker). Worker ``w`` holds stage
``w % pp`` of replica ``w // pp`` (``parallelism.Topology``'s rank order) and owns GPUs
``w*tp .. w*tp+tp-1``; GPUs fill nodes in order. So tensor parallelism stays inside a
node, one pipeline's stages are spread over consecutive nodes, and the replicas of one
stage sit on different nodes (``pp * tp >= gpus_per_node``). A node failure takes every
worker on that node; a rack failure every node of the rack.

Progress. Each seed carries ``q``, the *active time* the job has accumulated since its
start and kept (time it was neither stalled nor rolled back). Snapshots lie on a fixed
lattice in ``q``: every ``T1`` seconds of work the job writes a fast (in-memory) snapshot
for ``C1`` seconds, and every ``m``-th one is followed by a durable checkpoint write of
``C2`` seconds; a failure during a write loses that write. Useful training time is the
work part of ``q``; goodput is useful time over the horizon (the *effective training time
ratio*). Because the lattice is fixed in ``q`` -- checkpoints every ``n`` steps -- a
rollback to the last snapshot is ``q -> floor(q)``.

Events. Every failure event is, for each strategy, one *action* with two effects:

- a job-wide stall: the job makes no progress from the failure until
  ``failure + downtime`` (detection, replacement, group re-formation, state transfer or
  load). Stalls overlap: a failure during a recovery extends it, never shortens it.
- a progress map on ``q``: ``stall`` keeps it; ``rollback`` takes it to the last snapshot
  of a tier (fast, or durable when the fast tier is lost); ``approx`` (CheckFree's
  neighbour averaging, CheckFree+'s edge copy) loses ``approx_penalty_steps * step_s``
  per lost stage -- the convergence penalty -- but never more than a rollback would
  (the simulated planner rolls back instead when the last snapshot is that recent; such
  actions are logged as ``..._declined``); ``partial`` (CPR) keeps all but a fraction
  ``pls_penalty_scale * share`` of the progress since the snapshot, where ``share`` is the
  part of the model that was lost.

A killed worker stays *down* for its strategy's exact-recovery window (detection,
replacement, re-formation, transfer); a failure during the window restarts it. A stage
group is *lost* when every replica of the stage is down; a failure that loses a group
exhausts the redundancy. The fast snapshot tier lives in host memory, on the node and on
a partner node one pipeline replica away; it survives GPU failures and is lost when a
node and its partner are down together (then rollbacks go to the durable tier).

Strategies (actions as event logs name them):

- ``checkpoint_restart``: every failure is a ``restart`` -- detection, whole-job restart,
  checkpoint load, back to the last durable checkpoint, taken every ``T`` of work with
  ``T`` from Daly's formula for the job MTBF (the baseline torchrun / Ray Train give).
- ``peer_snapshot`` (Gemini): every failure is a ``rollback`` of every worker to the last
  in-memory snapshot after replacing the dead ones; ``fallback_durable`` when the snapshot
  tier is lost.
- ``replica_copy`` (Oobleck, torchft): ``replica_copy`` from a live replica, no lost work;
  ``fallback_rollback`` (or ``fallback_durable``) when a group is lost.
- ``checkfree`` / ``checkfree+``: as ``replica_copy`` while a replica lives; a lost group is
  rebuilt ``approximate``-ly from its neighbours, except a first or last stage
  (``checkfree`` only) or a group whose neighbour group is also lost, which roll back.
- ``embedding_partial`` (CPR): as ``replica_copy`` while a replica lives; a lost group is
  restored stale from its snapshot (``partial_restore``) while the others keep training.

Peer-based strategies write fast snapshots every 50 steps and a durable checkpoint
every 3 h of work (:class:`SnapshotPolicy`); they replace dead workers from warm spares.

Monotone by construction. Every action maps (progress, stall end) monotonically and
never improves on the action the same failure gets with fewer failures around it: a
fallback's downtime is clamped to be at least that of the path it falls back from, an
approximate recovery never costs more than a rollback. Hence, for the same seed, adding
failures never raises goodput (the property test checks this by thinning).

Fidelity limits -- what this model does *not* capture:

- Every recovery stalls the whole job; survivors do not train on with fewer replicas
  while a replacement starts (torchft-style elastic data parallelism would lose less).
- Costs are constants: no spare-pool exhaustion or queueing for hardware, no network
  contention when many transfers run at once, equal state per stage (real first/last
  stages carry the embeddings), no slowdowns or stragglers.
- Failures are independent except for the node/rack grouping; no cascades, no silent
  data corruption, no correlated software failures across nodes.
- The convergence penalty is a fixed amount of progress per approximate recovery and
  the CPR penalty is proportional to staleness times share (the PLS proxy); neither
  depends on when in training, or which stage, the failure hits. Calibrate them.
- Training is measured as progress, not loss: goodput says how much of the wall time
  turned into training that was kept, assuming kept progress is worth the same under
  every strategy.
- Approximations are charged in progress space, so a snapshot the job had already
  passed is written again after one (at most one extra write per approximation), and a
  lost group counts as down for the exact-recovery window even when its approximate
  rebuild or rollback takes longer.
- Placement is fixed (see Job above); with ``pp * tp < gpus_per_node`` several replicas
  of a stage share a node and one node failure can lose the whole group.
- The Monte Carlo confidence interval covers sampling noise only, not the uncertainty
  of the cost model or of the failure rate.
"""

from __future__ import annotations

import itertools
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np

from simulations.costs import CostModel, daly_interval, young_interval
from simulations.traces import ClusterShape, FailureEvents, FailureModel

__all__ = [
    "CAUSES",
    "STRATEGIES",
    "ActionKind",
    "CheckFree",
    "CheckFreePlus",
    "CheckpointRestart",
    "EmbeddingPartial",
    "EventFacts",
    "EventLog",
    "Job",
    "Layout",
    "PeerSnapshot",
    "Plan",
    "ReplicaCopy",
    "Scenario",
    "Schedule",
    "SimContext",
    "SimulationResult",
    "SnapshotPolicy",
    "Strategy",
    "StrategyResult",
    "classify_events",
    "exhaustion_probability",
    "expected_exhaustions",
    "make_strategy",
    "mean_ci",
    "simulate",
    "sweep",
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

_EFFECTS = ("stall", "approx", "partial", "rollback")
_TIERS = ("fast", "durable")
_EPS = 1e-9  # lattice slack, in periods: q within 1e-9 of a period of a lattice point is on it
_NO_DURABLE = float(2**40)  # "never": fast periods per durable checkpoint when there is none


# --------------------------------------------------------------------------- job layout


def _pos_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a job's GPUs are split: ``pp`` pipeline stages x ``dp`` replicas x ``tp`` GPUs.

    Raises:
        ValueError: if a degree is not a positive integer.
    """

    pp: int
    """Pipeline stages per replica."""
    dp: int
    """Data-parallel pipeline replicas."""
    tp: int = 1
    """GPUs per worker (tensor parallelism)."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            _pos_int(f"Layout.{name}", getattr(self, name))

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def workers(self) -> int:
        return self.pp * self.dp

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``"pp=16,dp=128,tp=8"`` (any order; ``tp`` defaults to 1).

        Raises:
            ValueError: on an unknown key, a missing ``pp``/``dp`` or a non-integer value.
        """
        values: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("pp", "dp", "tp") or key in values:
                raise ValueError(f"bad layout {text!r}: expected 'pp=<n>,dp=<n>[,tp=<n>]'")
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(
                    f"bad layout {text!r}: {key}={value!r} is not an integer"
                ) from None
        if "pp" not in values or "dp" not in values:
            raise ValueError(f"bad layout {text!r}: pp and dp are required")
        return cls(**values)

    @classmethod
    def default_for(cls, gpus: int) -> Layout:
        """A plausible layout for ``gpus``: tp=8 when it divides, up to 16 stages.

        Raises:
            ValueError: if ``gpus`` is not a positive integer.
        """
        gpus = _pos_int("gpus", gpus)
        tp = 8 if gpus % 8 == 0 else 1
        pp = next(p for p in (16, 8, 4, 2, 1) if (gpus // tp) % p == 0)
        return cls(pp=pp, dp=gpus // (tp * pp), tp=tp)

    def __str__(self) -> str:
        return f"pp={self.pp},dp={self.dp},tp={self.tp}"


@dataclass(frozen=True, kw_only=True)
class Job:
    """A training job: its size, its layout and the hardware grouping it runs on.

    Raises:
        ValueError: if ``pp * dp * tp`` differs from ``gpus`` or a count is not positive.
    """

    gpus: int
    layout: Layout
    gpus_per_node: int = 8
    nodes_per_rack: int = 2

    def __post_init__(self) -> None:
        _pos_int("Job.gpus", self.gpus)
        _pos_int("Job.gpus_per_node", self.gpus_per_node)
        _pos_int("Job.nodes_per_rack", self.nodes_per_rack)
        if not isinstance(self.layout, Layout):
            raise ValueError(f"Job.layout must be a Layout, got {self.layout!r}")
        if self.layout.gpus != self.gpus:
            raise ValueError(
                f"layout {self.layout} has {self.layout.gpus} GPUs but the job has {self.gpus}: "
                "pp * dp * tp must equal the number of GPUs"
            )

    @property
    def cluster(self) -> ClusterShape:
        return ClusterShape(
            gpus=self.gpus, gpus_per_node=self.gpus_per_node, nodes_per_rack=self.nodes_per_rack
        )

    @property
    def partner_offset(self) -> int:
        """Distance, in nodes, from a node to the node holding its snapshot copy (0: none)."""
        nodes = self.cluster.nodes
        if nodes == 1:
            return 0
        per_replica = (self.layout.pp * self.layout.tp) // self.gpus_per_node
        return per_replica if 0 < per_replica < nodes else 1

    def __str__(self) -> str:
        return f"{self.gpus:,} GPUs ({self.layout})"


# --------------------------------------------------------------------------- analytics


def exhaustion_probability(*, replicas: int, worker_rate_per_s: float, window_s: float) -> float:
    """P(a worker's failure finds every other replica of its stage down).

    Definition: a stage group's redundancy is *exhausted* by a failure of one of its
    workers at time ``t`` if each of the other ``R - 1`` replicas of that stage failed
    within ``(t - w, t]``, i.e. is still down in its recovery window ``w`` (a failure
    during a window restarts it, so a worker is down at ``t`` exactly when it failed at
    least once in the last ``w``).

    Derivation, for workers failing independently as Poisson processes of rate ``λ``:
    a failure at ``t`` sees the other workers as an outside observer would (PASTA), and
    each is down with probability ``P(at least one failure in w) = 1 - e^{-λw}``,
    independently. So ``p = (1 - e^{-λw})^{R-1}`` (``p = 1`` for ``R = 1``).

    Raises:
        ValueError: for ``replicas < 1`` or a negative rate or window.
    """
    _pos_int("replicas", replicas)
    if worker_rate_per_s < 0 or window_s < 0:
        raise ValueError(f"rate and window must be >= 0, got {worker_rate_per_s!r}, {window_s!r}")
    return float(-math.expm1(-worker_rate_per_s * window_s)) ** (replicas - 1)


def expected_exhaustions(
    *, stages: int, replicas: int, worker_rate_per_s: float, window_s: float, horizon_s: float
) -> float:
    """Expected number of exhausting failures over ``[0, horizon_s)`` (see
    :func:`exhaustion_probability`), for a job whose workers start alive at ``t = 0``.

    ``E = S R λ ∫_0^H (1 - e^{-λ min(t, w)})^{R-1} dt``: each of the ``S R`` workers fails
    at rate ``λ``, and before ``t = w`` the others have had only ``t`` to fail. The
    probability of at least one exhaustion is ``1 - e^{-E}`` when they are rare.

    Raises:
        ValueError: for non-positive counts or horizon, or a negative rate or window.
    """
    _pos_int("stages", stages)
    p = exhaustion_probability(
        replicas=replicas, worker_rate_per_s=worker_rate_per_s, window_s=window_s
    )
    if not horizon_s > 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s!r}")
    ramp = min(window_s, horizon_s)
    t = np.linspace(0.0, ramp, 2001)
    ramp_integral = (
        float(np.trapezoid((-np.expm1(-worker_rate_per_s * t)) ** (replicas - 1), t))
        if ramp > 0
        else 0.0
    )
    return stages * replicas * worker_rate_per_s * ((horizon_s - ramp) * p + ramp_integral)


def mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t confidence interval of per-seed values.

    The t quantile uses the Cornish-Fisher expansion (within 0.3% for 3+ degrees of
    freedom), so no scipy is needed. With one value the interval is ``(nan, nan)``.

    Raises:
        ValueError: if ``level`` is not in (0, 1) or ``values`` is empty.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("mean_ci needs at least one value")
    m = float(x.mean())
    n = x.size
    if n < 2:
        return m, math.nan, math.nan
    z = _normal_quantile(0.5 + level / 2)
    nu = n - 1
    t = (
        z
        + (z**3 + z) / (4 * nu)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3)
    )
    half = t * float(x.std(ddof=1)) / math.sqrt(n)
    return m, m - half, m + half


def _normal_quantile(p: float) -> float:
    # Acklam's rational approximation refined by one Newton step: |error| < 1e-12.
    a = (
        -39.69683028665376,
        220.9460984245205,
        -275.9285104469687,
        138.3577518672690,
        -30.66479806614716,
        2.506628277459239,
    )
    b = (
        -54.47609879822406,
        161.5858368580409,
        -155.6989798598866,
        66.80131188771972,
        -13.28068155288572,
    )
    c = (
        -0.007784894002430293,
        -0.3223964580411365,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    )
    d = (0.007784695709041462, 0.3224671290700398, 2.445134137142996, 3.754408661907416)
    if p < 0.02425:
        s = math.sqrt(-2 * math.log(p))
        x = (((((c[0] * s + c[1]) * s + c[2]) * s + c[3]) * s + c[4]) * s + c[5]) / (
            (((d[0] * s + d[1]) * s + d[2]) * s + d[3]) * s + 1
        )
    elif p > 1 - 0.02425:
        return -_normal_quantile(1 - p)
    else:
        s = p - 0.5
        r = s * s
        x = (
            (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5])
            * s
            / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
        )
    err = 0.5 * math.erfc(-x / math.sqrt(2)) - p
    return x - err * math.sqrt(2 * math.pi) * math.exp(x * x / 2)


# --------------------------------------------------------------------------- strategies


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
    """Index into the strategy's :meth:`Strategy.kinds`."""
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
        per_gpu = nbytes / (self.job.layout.pp * self.job.layout.tp)
        return per_gpu / self.costs.transfer_bytes_per_s


class Strategy(ABC):
    """A recovery strategy as the simulator sees it: a snapshot schedule, the actions it
    may take, and a vectorised rule choosing one per failure event."""

    name: ClassVar[str]
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
class CheckpointRestart(Strategy):
    """The baseline: every failure restarts the whole job from the last durable checkpoint.

    Each failure costs detection, a whole-job restart, the checkpoint load and the work
    since the last checkpoint; every ``T`` of work costs a checkpoint write ``C``, with ``T``
    from Daly's (default) or Young's formula for the job MTBF, or given.

    Raises:
        ValueError: for a non-positive interval or an unknown formula.
    """

    name: ClassVar[str] = "checkpoint_restart"
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
        return (ActionKind(name="restart", effect="rollback", tier="durable", downtime=down),)

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
class _PeerStrategy(Strategy):
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
        return ActionKind(name="replica_copy", effect="stall", downtime=down)

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
                name="fallback_rollback",
                effect="rollback",
                tier="fast",
                downtime={cause: fast},
                loss_cause=cause,
            ),
            ActionKind(
                name="fallback_durable",
                effect="rollback",
                tier="durable",
                downtime={cause: durable},
                loss_cause=cause,
            ),
        )

    def down_window_s(self, ctx: SimContext) -> float | None:
        return self._copy(ctx).total_s


@dataclass(frozen=True, kw_only=True)
class PeerSnapshot(_PeerStrategy):
    """Gemini-style: every failure rolls every worker back to the last in-memory snapshot
    (fast reload); the durable checkpoint only when the snapshot tier itself is lost."""

    name: ClassVar[str] = "peer_snapshot"
    exact: ClassVar[bool] = True

    def kinds(self, ctx: SimContext) -> tuple[ActionKind, ...]:
        c = ctx.costs
        down = _downtime(
            detection=c.detect_s, replacement=self._replace_s(ctx), transfer=self._fast_load_s(ctx)
        )
        rollback = ActionKind(name="rollback", effect="rollback", tier="fast", downtime=down)
        return rollback, self._fallbacks(ctx, rollback.total_s)[1]

    def down_window_s(self, ctx: SimContext) -> float | None:
        return self.kinds(ctx)[0].total_s

    def plan(self, facts: EventFacts, ctx: SimContext) -> Plan:
        return Plan(kind=facts.tier_lost.astype(np.int64))


@dataclass(frozen=True, kw_only=True)
class ReplicaCopy(_PeerStrategy):
    """Oobleck/torchft-style: a replacement copies the state of a live replica of its
    stage (exact, no lost work); when none is alive, roll back."""

    name: ClassVar[str] = "replica_copy"
    exact: ClassVar[bool] = True

    def kinds(self, ctx: SimContext) -> tuple[ActionKind, ...]:
        copy = self._copy(ctx)
        return (copy, *self._fallbacks(ctx, copy.total_s))

    def plan(self, facts: EventFacts, ctx: SimContext) -> Plan:
        kind = np.where(facts.lost_stages > 0, np.where(facts.tier_lost, 2, 1), 0)
        return Plan(kind=kind)


@dataclass(frozen=True, kw_only=True)
class CheckFree(_PeerStrategy):
    """CheckFree: replica copy while a replica lives; a lost stage group is rebuilt as the
    gradient-norm-weighted average of its neighbours (approximate, with a convergence
    penalty); the first and last stage, or two adjacent lost groups, fall back to rollback."""

    name: ClassVar[str] = "checkfree"
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

    name: ClassVar[str] = "checkfree+"
    handles_edges: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class EmbeddingPartial(_PeerStrategy):
    """CPR-style partial recovery: replica copy while a replica lives; a lost group's
    state is restored stale from its last snapshot while every other worker keeps its
    current state (no rollback); penalty proportional to the lost updates (PLS).

    Meant for embedding-dominated (recommendation) jobs, where each worker holds shards
    of sparse tables; for dense models stale layers cost more than the PLS proxy says."""

    name: ClassVar[str] = "embedding_partial"
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


STRATEGIES: dict[str, type[Strategy]] = {
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
"""Every built-in strategy by name, in table order."""


def make_strategy(name: str, **options: Any) -> Strategy:
    """Build a built-in strategy by name.

    Raises:
        ValueError: for an unknown name or option.
    """
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    try:
        return STRATEGIES[name](**options)
    except TypeError as err:
        raise ValueError(f"bad options for strategy {name!r}: {err}") from err


# --------------------------------------------------------------------------- classification


def classify_events(events: FailureEvents, job: Job, window_s: float) -> EventFacts:
    """What each failure event leaves behind when a killed worker stays down ``window_s``.

    Vectorised for events with no other event of their seed within the window (nearly
    all of them); the rest are resolved exactly, one by one.

    Raises:
        ValueError: if the events were drawn for another cluster, or ``window_s < 0``.
    """
    if events.cluster != job.cluster:
        raise ValueError(f"events were drawn for {events.cluster}, the job runs on {job.cluster}")
    if not window_s >= 0:
        raise ValueError(f"window_s must be >= 0, got {window_s!r}")
    s_count, r_count, tp = job.layout.pp, job.layout.dp, job.layout.tp
    gpn, nodes, off = job.gpus_per_node, job.cluster.nodes, job.partner_offset
    n = len(events)
    first, last = events.first_gpu, events.first_gpu + events.num_gpus - 1
    lo, hi = first // tp, last // tp
    host = events.component > 0
    nlo, nhi = first // gpn, last // gpn
    # Event i's window: the events of its seed from ``start[i]`` to i that struck within
    # ``(t_i - w, t_i]``; i itself always counts (its workers are down from its instant on).
    start = np.empty(n, dtype=np.int64)
    for a, b in itertools.pairwise(events.offsets.tolist()):
        t = events.time_s[a:b]
        start[a:b] = a + np.searchsorted(t, t - window_s, side="right")
    idx = np.arange(n)
    start = np.minimum(start, idx)
    alone = start == idx

    # One event alone: stage s is fully down iff every replica's worker r*S+s is in [lo, hi].
    top = np.minimum(s_count - 1, hi - (r_count - 1) * s_count)
    lost = np.where(lo < s_count, np.maximum(0, top - lo + 1), 0)
    edge = (lost > 0) & ((lo == 0) | (top == s_count - 1))
    adjacent = lost >= 2
    span = nhi - nlo
    tier_lost = host & ((off == 0) | (span >= off) | (span >= nodes - off))

    # Exhaustion needs R distinct replicas down; bound them by the replicas each window event touches.
    touched = np.concatenate([[0], np.cumsum(hi // s_count - lo // s_count + 1)])
    feasible = touched[idx + 1] - touched[start] >= r_count
    host_sum = np.concatenate([[0], np.cumsum(host)])
    slow_lost = feasible & ~alone
    slow_tier = host & (host_sum[idx + 1] - host_sum[start] >= 2)
    lost[~feasible] = 0
    edge &= feasible
    adjacent &= feasible
    for i in np.flatnonzero(slow_lost | slow_tier).tolist():
        window = range(int(start[i]), i + 1)
        if slow_lost[i]:
            down: set[int] = set()
            for j in window:
                down.update(range(int(lo[j]), int(hi[j]) + 1))
            per_stage: dict[int, int] = {}
            for w in down:
                per_stage[w % s_count] = per_stage.get(w % s_count, 0) + 1
            mine = {
                w % s_count
                for w in range(int(lo[i]), min(int(hi[i]), int(lo[i]) + s_count - 1) + 1)
            }
            gone = [s for s in mine if per_stage[s] == r_count]
            lost[i] = len(gone)
            edge[i] = any(s in (0, s_count - 1) for s in gone)
            adjacent[i] = any(
                per_stage.get(s - 1, 0) == r_count or per_stage.get(s + 1, 0) == r_count
                for s in gone
            )
        if slow_tier[i]:
            dead: set[int] = set()
            for j in window:
                if host[j]:
                    dead.update(range(int(nlo[j]), int(nhi[j]) + 1))
            tier_lost[i] = off == 0 or any(
                (v + off) % nodes in dead or (v - off) % nodes in dead
                for v in range(int(nlo[i]), int(nhi[i]) + 1)
            )
    return EventFacts(
        lost_stages=lost.astype(np.int64), adjacent=adjacent, edge=edge, tier_lost=tier_lost
    )


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True, eq=False)
class EventLog:
    """Every failure event of every seed and what one strategy did about it."""

    action_names: tuple[str, ...]
    seed: np.ndarray
    time_s: np.ndarray
    component: np.ndarray
    """Kind code of the failed component (see ``simulations.traces.COMPONENTS``)."""
    first_gpu: np.ndarray
    num_gpus: np.ndarray
    action: np.ndarray
    """Index into :attr:`action_names`."""
    downtime_s: np.ndarray
    """Job-wide stall this event started (overlapping stalls are not double-counted in
    the per-cause totals)."""
    progress_lost_s: np.ndarray
    """Useful training time this event discarded (rollback, penalty, staleness)."""

    def __len__(self) -> int:
        return len(self.time_s)


@dataclass(frozen=True, kw_only=True, eq=False)
class StrategyResult:
    """One strategy's outcome, per Monte Carlo seed."""

    name: str
    exact: bool
    schedule: str
    """How its snapshots and checkpoints were scheduled."""
    horizon_s: float
    goodput: np.ndarray
    """Useful training time over wall time, per seed."""
    lost_s: dict[str, np.ndarray]
    """Wall time lost per cause (:data:`CAUSES`), per seed; with the useful time they sum
    to the horizon."""
    actions: dict[str, np.ndarray]
    """Number of events per action, per seed."""
    events: EventLog | None = None

    def goodput_ci(self, level: float = 0.95) -> tuple[float, float, float]:
        """Mean goodput and its confidence interval over seeds."""
        return mean_ci(self.goodput, level)

    def lost_fraction(self) -> dict[str, float]:
        """Mean fraction of wall time lost per cause."""
        return {c: float(v.mean()) / self.horizon_s for c, v in self.lost_s.items()}

    def mean_actions(self) -> dict[str, float]:
        return {a: float(v.mean()) for a, v in self.actions.items()}


@dataclass(frozen=True, kw_only=True, eq=False)
class SimulationResult:
    """The outcome of :func:`simulate`: every strategy on the same failures."""

    job: Job
    horizon_s: float
    failures: str
    first_seed: int
    failures_per_seed: np.ndarray
    job_mtbf_s: float
    strategies: tuple[StrategyResult, ...]

    @property
    def num_seeds(self) -> int:
        return len(self.failures_per_seed)

    def __getitem__(self, name: str) -> StrategyResult:
        for result in self.strategies:
            if result.name == name:
                return result
        raise KeyError(
            f"no strategy {name!r} in this result; have {[r.name for r in self.strategies]}"
        )

    def table(self, level: float = 0.95) -> str:
        """Goodput with its confidence interval and the percent of wall time lost per
        cause, one row per strategy."""
        head = (
            f"{self.job}, {self.horizon_s / 86400:g} days, {self.failures}\n"
            f"{self.num_seeds} seeds, {self.failures_per_seed.mean():,.1f} failures per seed "
            f"(job MTBF {self.job_mtbf_s / 3600:,.2f} h); lost time in % of wall time\n"
        )
        short = {
            "detection": "detect",
            "replacement": "replace",
            "transfer": "transfer",
            "lost_work": "lost work",
            "checkpoint": "ckpt",
            "convergence": "converge",
            "exhausted": "exhausted",
        }
        cols = f"{'strategy':<20}{'goodput':>8}  {f'{level:.0%} CI':<17}" + "".join(
            f"{short[c]:>10}" for c in CAUSES
        )
        rows = [cols, "-" * len(cols)]
        for r in self.strategies:
            m, lo, hi = r.goodput_ci(level)
            lost = r.lost_fraction()
            ci = f"[{lo:.4f}, {hi:.4f}]" if math.isfinite(lo) else "-"
            rows.append(
                f"{r.name:<20}{m:>8.4f}  {ci:<17}"
                + "".join(f"{100 * lost[c]:>10.3f}" for c in CAUSES)
            )
        rows.append("")
        rows.append("actions per seed (mean) and schedules:")
        for r in self.strategies:
            acts = (
                ", ".join(f"{a} {v:,.1f}" for a, v in r.mean_actions().items() if v > 0) or "none"
            )
            rows.append(f"  {r.name:<20}{acts}; {r.schedule}")
        return head + "\n".join(rows)

    def to_dict(self, level: float = 0.95) -> dict[str, Any]:
        """A JSON-ready summary (means and confidence intervals, no per-event data)."""
        out: dict[str, Any] = {
            "gpus": self.job.gpus,
            "layout": str(self.job.layout),
            "horizon_s": self.horizon_s,
            "failures": self.failures,
            "seeds": self.num_seeds,
            "failures_per_seed": float(self.failures_per_seed.mean()),
            "job_mtbf_s": self.job_mtbf_s,
            "strategies": {},
        }
        for r in self.strategies:
            m, lo, hi = r.goodput_ci(level)
            out["strategies"][r.name] = {
                "exact": r.exact,
                "schedule": r.schedule,
                "goodput": m,
                "goodput_ci": [lo, hi],
                "lost_fraction": r.lost_fraction(),
                "actions_per_seed": r.mean_actions(),
            }
        return out

    @staticmethod
    def merge(results: Sequence[SimulationResult]) -> SimulationResult:
        """Concatenate results over disjoint seed ranges of one scenario (in order).

        Raises:
            ValueError: if the results are empty or describe different scenarios.
        """
        if not results:
            raise ValueError("nothing to merge")
        first = results[0]
        names = [r.name for r in first.strategies]
        for res in results[1:]:
            if (
                res.job != first.job
                or res.horizon_s != first.horizon_s
                or [r.name for r in res.strategies] != names
            ):
                raise ValueError("can only merge results of the same scenario")
        shifts = np.cumsum([0] + [r.num_seeds for r in results[:-1]])
        merged = []
        for k, base in enumerate(first.strategies):
            parts = [res.strategies[k] for res in results]
            logs = [p.events for p in parts]
            events = None
            if all(log is not None for log in logs):
                events = EventLog(
                    action_names=base.events.action_names,  # type: ignore[union-attr]
                    **{
                        name: np.concatenate(
                            [
                                getattr(log, name) + (shift if name == "seed" else 0)
                                for log, shift in zip(logs, shifts, strict=True)
                            ]
                        )
                        for name in (
                            "seed",
                            "time_s",
                            "component",
                            "first_gpu",
                            "num_gpus",
                            "action",
                            "downtime_s",
                            "progress_lost_s",
                        )
                    },
                )
            merged.append(
                replace(
                    base,
                    goodput=np.concatenate([p.goodput for p in parts]),
                    lost_s={c: np.concatenate([p.lost_s[c] for p in parts]) for c in CAUSES},
                    actions={
                        a: np.concatenate([p.actions[a] for p in parts]) for a in base.actions
                    },
                    events=events,
                )
            )
        counts = np.concatenate([r.failures_per_seed for r in results])
        return replace(first, failures_per_seed=counts, strategies=tuple(merged))


# --------------------------------------------------------------------------- the engine


class _Lattice:
    """Vectorised floor and useful-work functions of snapshot schedules."""

    def __init__(self, params: np.ndarray) -> None:
        # params: (..., 5) rows of (T1, K1, m, K2, continuous), broadcast against q.
        self.t1, self.k1, self.m, self.k2, cont = (params[..., i] for i in range(5))
        self.cont = cont.astype(bool)
        self.any_cont = bool(self.cont.any())

    def _split(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n2 = np.floor(q / self.k2 + _EPS)
        r = q - n2 * self.k2
        k = np.clip(np.floor(r / self.k1 + _EPS), 0.0, self.m)
        return n2, r, k

    def floors(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Progress at the last fast snapshot and at the last durable checkpoint."""
        n2, _, k = self._split(q)
        durable = n2 * self.k2
        fast = durable + k * self.k1
        if self.any_cont:
            return np.where(self.cont, q, fast), np.where(self.cont, q, durable)
        return fast, durable

    def useful(self, q: np.ndarray) -> np.ndarray:
        """The work part of progress ``q`` (``q`` minus the snapshot writes in it)."""
        n2, r, k = self._split(q)
        within = k * self.t1 + np.where(k < self.m, np.clip(r - k * self.k1, 0.0, self.t1), 0.0)
        out = n2 * self.m * self.t1 + within
        return np.where(self.cont, q, out) if self.any_cont else out


def _resolve(strategies: Sequence[Strategy | str] | None) -> list[Strategy]:
    if strategies is None:
        return [cls() for cls in STRATEGIES.values()]
    out = [make_strategy(s) if isinstance(s, str) else s for s in strategies]
    for s in out:
        if not isinstance(s, Strategy):
            raise ValueError(f"not a strategy: {s!r}")
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"strategy names must be unique, got {names}")
    if not out:
        raise ValueError("no strategies to simulate")
    return out


def simulate(
    job: Job,
    failures: FailureModel | FailureEvents,
    strategies: Sequence[Strategy | str] | None = None,
    *,
    horizon_s: float | None = None,
    costs: CostModel | None = None,
    seeds: int = 100,
    seed: int = 0,
    first_seed: int = 0,
    job_mtbf_s: float | None = None,
    keep_events: bool = True,
) -> SimulationResult:
    """Simulate ``job`` under ``failures`` for each strategy, on common random numbers.

    Args:
        job: size, layout and hardware grouping.
        failures: a failure model (sampled here for ``seeds`` seeds) or events already
            drawn (their horizon and seeds are used).
        strategies: strategy objects or names; ``None`` runs every built-in one.
        horizon_s: wall time simulated; required with a failure model.
        costs: the cost model (default: :class:`CostModel`'s defaults).
        seeds, seed, first_seed: Monte Carlo seeds ``first_seed .. first_seed+seeds-1``
            of base seed ``seed``.
        job_mtbf_s: mean time between failures of the whole job, for checkpoint
            intervals; default: from the failure model (or the events drawn).
        keep_events: keep the per-event log of every strategy.

    Raises:
        ValueError: for a missing or non-positive horizon, events drawn for another
            cluster, a bad strategy, or a bad schedule.
    """
    costs = CostModel() if costs is None else costs
    chosen = _resolve(strategies)
    if isinstance(failures, FailureEvents):
        events = failures
        if horizon_s is not None and horizon_s != events.horizon_s:
            raise ValueError(
                f"horizon_s={horizon_s} differs from the events' horizon {events.horizon_s}"
            )
        horizon = events.horizon_s
        if events.cluster != job.cluster:
            raise ValueError(
                f"events were drawn for {events.cluster}, the job runs on {job.cluster}"
            )
        description = "given failure events"
        mtbf = horizon * events.num_seeds / len(events) if len(events) else math.inf
    elif isinstance(failures, FailureModel):
        if horizon_s is None or not horizon_s > 0 or not math.isfinite(horizon_s):
            raise ValueError(f"horizon_s must be a positive number of seconds, got {horizon_s!r}")
        horizon = float(horizon_s)
        events = failures.sample(
            job.cluster, horizon, seeds=seeds, seed=seed, first_seed=first_seed
        )
        description = failures.describe()
        expected = failures.expected_events(job.cluster, horizon)
        mtbf = horizon / expected if expected > 0 else math.inf
    else:
        raise ValueError(f"failures must be a FailureModel or FailureEvents, got {failures!r}")
    if job_mtbf_s is not None:
        if not job_mtbf_s > 0:
            raise ValueError(f"job_mtbf_s must be > 0, got {job_mtbf_s!r}")
        mtbf = float(job_mtbf_s)
    ctx = SimContext(job=job, costs=costs, horizon_s=horizon, job_mtbf_s=mtbf)
    results = _run(events, chosen, ctx, keep_events)
    return SimulationResult(
        job=job,
        horizon_s=horizon,
        failures=description,
        first_seed=first_seed,
        failures_per_seed=events.counts(),
        job_mtbf_s=mtbf,
        strategies=tuple(results),
    )


@dataclass
class _Prepared:
    strategy: Strategy
    kinds: tuple[ActionKind, ...]
    kind: np.ndarray  # per event
    lattice_params: tuple[float, float, float, float, bool]
    schedule: Schedule


def _run(
    events: FailureEvents, strategies: list[Strategy], ctx: SimContext, keep_events: bool
) -> list[StrategyResult]:
    n_ev, n_seeds, n_strat = len(events), events.num_seeds, len(strategies)
    horizon = ctx.horizon_s
    counts = events.counts()
    width = max(1, int(counts.max()) if n_ev else 1)
    pos = np.arange(n_ev) - events.offsets[events.seed]
    col = events.seed

    # Per-strategy event parameters, padded to (width, strategy, seed); padding is a no-op event at the horizon.
    times = np.full((width, n_seeds), horizon)
    times[pos, col] = events.time_s
    down = np.zeros((width, n_strat, n_seeds))
    drop = np.zeros(
        (width, n_strat, n_seeds)
    )  # 1 - keep: share of progress since the snapshot lost
    penalty = np.full((width, n_strat, n_seeds), np.inf)
    durable = np.zeros((width, n_strat, n_seeds), dtype=bool)
    facts_cache: dict[float | None, EventFacts] = {}
    prepared: list[_Prepared] = []
    for i, strategy in enumerate(strategies):
        window = strategy.down_window_s(ctx)
        if window not in facts_cache:
            facts_cache[window] = (
                EventFacts.none(n_ev)
                if window is None
                else classify_events(events, ctx.job, window)
            )
        plan = strategy.plan(facts_cache[window], ctx)
        kinds = strategy.kinds(ctx)
        kind = np.asarray(plan.kind, dtype=np.int64)
        if kind.shape != (n_ev,) or (n_ev and (kind.min() < 0 or kind.max() >= len(kinds))):
            raise ValueError(f"strategy {strategy.name} planned invalid action kinds")
        effect = np.array([_EFFECTS.index(k.effect) for k in kinds])[kind]
        total = np.array([k.total_s for k in kinds])[kind]
        tier = np.array([k.tier == "durable" for k in kinds])[kind]
        ev_drop = np.where(effect == _EFFECTS.index("stall"), 0.0, 1.0)
        ev_pen = np.full(n_ev, np.inf)
        is_approx = effect == _EFFECTS.index("approx")
        if is_approx.any():
            if plan.penalty_s is None:
                raise ValueError(
                    f"strategy {strategy.name} plans approximate actions without a penalty"
                )
            ev_pen[is_approx] = np.asarray(plan.penalty_s, dtype=np.float64)[is_approx]
        is_partial = effect == _EFFECTS.index("partial")
        if is_partial.any():
            if plan.keep is None:
                raise ValueError(
                    f"strategy {strategy.name} plans partial actions without a keep fraction"
                )
            ev_drop[is_partial] = 1.0 - np.asarray(plan.keep, dtype=np.float64)[is_partial]
        down[pos, i, col] = total
        drop[pos, i, col] = ev_drop
        penalty[pos, i, col] = ev_pen
        durable[pos, i, col] = tier
        schedule = strategy.schedule(ctx)
        prepared.append(_Prepared(strategy, kinds, kind, schedule.params(horizon), schedule))

    params = np.array([p.lattice_params for p in prepared], dtype=np.float64)
    lattice = _Lattice(params[:, None, :])
    q = np.zeros((n_strat, n_seeds))
    busy = np.zeros((n_strat, n_seeds))
    t_prev = np.zeros(n_seeds)
    q_before = np.empty((width, n_strat, n_seeds))
    q_after = np.empty((width, n_strat, n_seeds))
    cover_from = np.empty((width, n_strat, n_seeds))
    # The recurrence: one step per event index, every strategy and seed at once.
    for j in range(width):
        t = times[j]
        q += np.maximum(t - np.maximum(busy, t_prev), 0.0)
        np.maximum(busy, t, out=cover_from[j])
        q_before[j] = q
        fast, dur = lattice.floors(q)
        base = np.where(durable[j], dur, fast)
        q = np.maximum(q - drop[j] * (q - base), q - penalty[j])
        q_after[j] = q
        busy = np.maximum(busy, t + down[j])
        t_prev = t
    q += np.maximum(horizon - np.maximum(busy, t_prev), 0.0)

    return [
        _summarise(
            p,
            i,
            events,
            ctx,
            times,
            down[:, i],
            penalty[:, i],
            durable[:, i],
            q_before[:, i],
            q_after[:, i],
            cover_from[:, i],
            q[i],
            pos,
            keep_events,
        )
        for i, p in enumerate(prepared)
    ]


def _summarise(
    prep: _Prepared,
    i: int,
    events: FailureEvents,
    ctx: SimContext,
    times: np.ndarray,
    down: np.ndarray,
    penalty: np.ndarray,
    durable: np.ndarray,
    q_before: np.ndarray,
    q_after: np.ndarray,
    cover_from: np.ndarray,
    q_final: np.ndarray,
    pos: np.ndarray,
    keep_events: bool,
) -> StrategyResult:
    horizon, n_seeds, width = ctx.horizon_s, events.num_seeds, times.shape[0]
    lattice = _Lattice(np.array(prep.lattice_params, dtype=np.float64))
    kinds = list(prep.kinds)
    # Approximate actions that the penalty cap turned into rollbacks get their own label.
    declined: dict[int, int] = {}
    for k, approx in enumerate(prep.kinds):
        if approx.effect == "approx":
            declined[k] = len(kinds)
            kinds.append(
                ActionKind(
                    name=f"{approx.name}_declined",
                    effect="rollback",
                    tier=approx.tier,
                    downtime={"exhausted": approx.total_s},
                    loss_cause="exhausted",
                )
            )
    none_kind = len(kinds)
    kind = np.full((width, n_seeds), none_kind, dtype=np.int64)
    kind[pos, events.seed] = prep.kind
    if declined:
        fast, dur = lattice.floors(q_before)
        base = np.where(durable, dur, fast)
        capped = q_before - penalty <= base
        for k, d in declined.items():
            kind[(kind == k) & capped] = d

    # Stall time newly covered by each event, split over its phases in cause order.
    phases = np.zeros((none_kind + 1, len(CAUSES)))
    for k, kd in enumerate(kinds):
        for cause, seconds in kd.downtime.items():
            phases[k, CAUSES.index(cause)] = seconds
    ends = np.cumsum(phases, axis=1)[kind]
    starts = ends - phases[kind]
    rel_from = (cover_from - times)[..., None]
    rel_to = (np.minimum(times + down, horizon) - times)[..., None]
    stall = np.clip(np.minimum(ends, rel_to) - np.maximum(starts, rel_from), 0.0, None).sum(axis=0)

    # Progress discarded by each event: its work part goes to the action's cause, the rest was snapshot writing.
    useful_lost = lattice.useful(q_before) - lattice.useful(q_after)
    writes_lost = (q_before - q_after) - useful_lost
    loss_cause = np.array([CAUSES.index(kd.loss_cause) for kd in kinds] + [0])[kind]
    lost = stall.T.copy()  # (cause, seed)
    for c in range(len(CAUSES)):
        lost[c] += np.where(loss_cause == c, useful_lost, 0.0).sum(axis=0)
    useful_final = lattice.useful(q_final)
    lost[CAUSES.index("checkpoint")] += writes_lost.sum(axis=0) + (q_final - useful_final)

    names = tuple(kd.name for kd in kinds)
    flat = (kind * n_seeds + np.arange(n_seeds)).ravel()
    tally = np.bincount(flat, minlength=(none_kind + 1) * n_seeds).reshape(none_kind + 1, n_seeds)
    log = None
    if keep_events:
        log = EventLog(
            action_names=names,
            seed=events.seed,
            time_s=events.time_s,
            component=events.component,
            first_gpu=events.first_gpu,
            num_gpus=events.num_gpus,
            action=kind[pos, events.seed],
            downtime_s=down[pos, events.seed],
            progress_lost_s=useful_lost[pos, events.seed],
        )
    return StrategyResult(
        name=prep.strategy.name,
        exact=prep.strategy.exact,
        schedule=prep.schedule.label,
        horizon_s=horizon,
        goodput=np.clip(useful_final / horizon, 0.0, 1.0),
        lost_s={c: lost[k] for k, c in enumerate(CAUSES)},
        actions={name: tally[k] for k, name in enumerate(names)},
        events=log,
    )


# --------------------------------------------------------------------------- sweeps


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One :func:`simulate` call, as data (so a sweep can ship it to a Ray worker)."""

    job: Job
    failures: FailureModel
    horizon_s: float
    strategies: tuple[Strategy | str, ...] | None = None
    costs: CostModel | None = None
    seeds: int = 100
    seed: int = 0
    first_seed: int = 0
    keep_events: bool = False

    def run(self) -> SimulationResult:
        """Simulate this scenario here.

        Raises:
            ValueError: as :func:`simulate`.
        """
        return simulate(
            self.job,
            self.failures,
            self.strategies,
            horizon_s=self.horizon_s,
            costs=self.costs,
            seeds=self.seeds,
            seed=self.seed,
            first_seed=self.first_seed,
            keep_events=self.keep_events,
        )

    def split(self, chunks: int) -> list[Scenario]:
        """The same scenario as ``chunks`` disjoint seed ranges (merge the results with
        :meth:`SimulationResult.merge`); identical to running it whole."""
        chunks = max(1, min(_pos_int("chunks", chunks), self.seeds))
        bounds = np.linspace(0, self.seeds, chunks + 1).round().astype(int)
        return [
            replace(self, seeds=int(b - a), first_seed=self.first_seed + int(a))
            for a, b in itertools.pairwise(bounds)
        ]


def _run_scenario(scenario: Scenario) -> SimulationResult:
    return scenario.run()


def sweep(
    scenarios: Sequence[Scenario],
    *,
    use_ray: bool = False,
    timeout: timedelta = timedelta(hours=1),
) -> list[SimulationResult]:
    """Run many scenarios, here one after another or as Ray tasks across a cluster.

    With ``use_ray``, connects to the cluster named by ``RAY_ADDRESS`` or starts a local
    Ray bound to 127.0.0.1, and waits at most ``timeout`` for all results.

    Raises:
        ValueError: as :func:`simulate`, for a scenario that is invalid.
        TimeoutError: if Ray does not return every result within ``timeout``.
    """
    if not use_ray:
        return [s.run() for s in scenarios]
    import ray  # only sweeps on a cluster need Ray
    from ray.exceptions import GetTimeoutError

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            # address="local": never attach to some other process's Ray on this machine.
            ray.init(
                address="local",
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
            )
    remote = ray.remote(_run_scenario)
    refs = [remote.remote(s) for s in scenarios]
    try:
        return list(ray.get(refs, timeout=timeout.total_seconds()))
    except GetTimeoutError as err:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise TimeoutError(f"{len(refs)} simulation tasks did not finish within {timeout}") from err
