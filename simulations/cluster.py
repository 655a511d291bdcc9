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
  stages carry the embeddings); stragglers only as ``[Note: straggler model]`` in
  :mod:`simulations.stragglers` describes them (one slow pace for the whole job).
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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import numpy as np

from simulations.analytics import exhaustion_probability, expected_exhaustions, mean_ci
from simulations.classify import classify_events
from simulations.costs import CostModel
from simulations.layout import Job, Layout, _pos_int
from simulations.policy_models import (
    _EFFECTS,
    _ROLLBACK,
    CAUSES,
    POLICY_MODELS,
    ActionKind,
    CheckFree,
    CheckFreePlus,
    CheckpointRestart,
    EmbeddingPartial,
    EventFacts,
    PeerSnapshot,
    Plan,
    PolicyModel,
    ReplicaCopy,
    Schedule,
    SimContext,
    SnapshotPolicy,
    make_policy_model,
)
from simulations.results import EventLog, SimulationResult, StrategyResult
from simulations.stragglers import StragglerDraws, StragglerModel, WorkClock
from simulations.traces import FailureEvents, FailureModel

# The engine's public names, and those of the modules it is built from (re-exported so
# that ``simulations.cluster`` stays the one import of the cluster simulator).
__all__ = [
    "CAUSES",
    "POLICY_MODELS",
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
    "PolicyModel",
    "ReplicaCopy",
    "Scenario",
    "Schedule",
    "SimContext",
    "SimulationResult",
    "SnapshotPolicy",
    "StrategyResult",
    "classify_events",
    "exhaustion_probability",
    "expected_exhaustions",
    "make_policy_model",
    "mean_ci",
    "simulate",
    "sweep",
]

_EPS = 1e-9  # lattice slack, in periods: q within 1e-9 of a period of a lattice point is on it

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


def _resolve(strategies: Sequence[PolicyModel | str] | None) -> list[PolicyModel]:
    if strategies is None:
        return [cls() for cls in POLICY_MODELS.values()]
    out = [make_policy_model(s) if isinstance(s, str) else s for s in strategies]
    for s in out:
        if not isinstance(s, PolicyModel):
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
    strategies: Sequence[PolicyModel | str] | None = None,
    *,
    horizon_s: float | None = None,
    costs: CostModel | None = None,
    seeds: int = 100,
    seed: int = 0,
    first_seed: int = 0,
    job_mtbf_s: float | None = None,
    keep_events: bool = True,
    stragglers: StragglerModel | StragglerDraws | None = None,
    mitigate_stragglers: bool = False,
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
        stragglers: slow workers (a model, sampled here on its own random stream, or
            episodes already drawn); ``None`` or a zero rate: none, and the result is
            exactly the one without this argument. See ``[Note: straggler model]``.
        mitigate_stragglers: replace each straggler's worker once detected, as a
            failure of it (every strategy its own way); else it stays slow.

    Raises:
        ValueError: for a missing or non-positive horizon, events drawn for another
            cluster, a bad strategy, a bad schedule, or straggler draws for another run.
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
    slow = None
    if isinstance(stragglers, StragglerModel) and not stragglers.active:
        stragglers = None
    if isinstance(stragglers, StragglerModel):
        stragglers = stragglers.sample(
            job, horizon, seeds=events.num_seeds, seed=seed, first_seed=first_seed
        )
    clock = None
    if stragglers is not None:
        if stragglers.job != job or stragglers.horizon_s != horizon:
            raise ValueError("straggler draws were made for another job or horizon")
        if len(stragglers):
            clock = stragglers.clock(costs.step_s, mitigated=mitigate_stragglers)
            if mitigate_stragglers:
                events = stragglers.with_kills(events, costs.step_s)
        slow = (stragglers.counts(), stragglers.counts(costs.step_s))
    results = _run(events, chosen, ctx, keep_events, clock)
    return SimulationResult(
        job=job,
        horizon_s=horizon,
        failures=description,
        first_seed=first_seed,
        failures_per_seed=events.counts(),
        job_mtbf_s=mtbf,
        strategies=tuple(results),
        stragglers_per_seed=None if slow is None else slow[0],
        stragglers_handled_per_seed=None if slow is None or not mitigate_stragglers else slow[1],
    )


@dataclass
class _Prepared:
    strategy: PolicyModel
    kinds: tuple[ActionKind, ...]
    kind: np.ndarray  # per event
    lattice_params: tuple[float, float, float, float, bool]
    schedule: Schedule


def _run(
    events: FailureEvents,
    strategies: list[PolicyModel],
    ctx: SimContext,
    keep_events: bool,
    clock: WorkClock | None = None,
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
    slow_lost = np.zeros((n_strat, n_seeds))

    def advance(q: np.ndarray, t: np.ndarray) -> None:
        # Work done from the end of the last stall (or event) to t; at a straggler's pace.
        since = np.maximum(busy, t_prev)
        wall = np.maximum(t - since, 0.0)
        if clock is None:
            q += wall
            return
        work = np.maximum(clock(np.broadcast_to(t, since.shape)) - clock(since), 0.0)
        q += work
        slow_lost[...] += wall - work

    # The recurrence: one step per event index, every strategy and seed at once.
    for j in range(width):
        t = times[j]
        advance(q, t)
        np.maximum(busy, t, out=cover_from[j])
        q_before[j] = q
        fast, dur = lattice.floors(q)
        base = np.where(durable[j], dur, fast)
        q = np.maximum(q - drop[j] * (q - base), q - penalty[j])
        q_after[j] = q
        busy = np.maximum(busy, t + down[j])
        t_prev = t
    advance(q, np.full(n_seeds, horizon))

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
            None if clock is None else slow_lost[i],
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
    slow_lost: np.ndarray | None = None,
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
                    effect=_ROLLBACK,
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
    lost_s = {c: lost[k] for k, c in enumerate(CAUSES)}
    if slow_lost is not None:
        lost_s["slow"] = slow_lost

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
        lost_s=lost_s,
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
    strategies: tuple[PolicyModel | str, ...] | None = None
    costs: CostModel | None = None
    seeds: int = 100
    seed: int = 0
    first_seed: int = 0
    keep_events: bool = False
    stragglers: StragglerModel | None = None
    mitigate_stragglers: bool = False

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
            stragglers=self.stragglers,
            mitigate_stragglers=self.mitigate_stragglers,
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

    from recovery.groups.ray_env import connect  # the one embedded Ray: loopback only

    connect(log_to_driver=False)
    remote = ray.remote(_run_scenario)
    refs = [remote.remote(s) for s in scenarios]
    try:
        return list(ray.get(refs, timeout=timeout.total_seconds()))
    except GetTimeoutError as err:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise TimeoutError(f"{len(refs)} simulation tasks did not finish within {timeout}") from err
