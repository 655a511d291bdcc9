"""Tests for the cluster simulator: validation against closed forms, properties, bad input.

The validations (ISSUE item 3): checkpoint-restart matches Young's and Daly's analytic
waste within 3%, zero costs give goodput 1, and the frequency of redundancy exhaustion
matches its closed form. Properties (hypothesis): goodput stays in [0, 1] and the time
lost per cause adds up to the horizon; thinning the failures of a seed never lowers
goodput; exact strategies never pay a convergence penalty; the vectorised event
classification agrees with a brute-force one. Every strategy passes one conformance test.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from simulations.cluster import (
    CAUSES,
    POLICY_MODELS,
    CheckFree,
    CheckFreePlus,
    CheckpointRestart,
    EmbeddingPartial,
    Job,
    Layout,
    PeerSnapshot,
    PolicyModel,
    ReplicaCopy,
    Scenario,
    SimContext,
    SimulationResult,
    SnapshotPolicy,
    classify_events,
    exhaustion_probability,
    expected_exhaustions,
    make_policy_model,
    mean_ci,
    simulate,
    sweep,
)
from simulations.costs import CostModel, daly_interval, daly_waste, young_interval, young_waste
from simulations.traces import (
    ClusterShape,
    ExponentialFailures,
    FailureEvents,
    MixedFailures,
    llama3_failures,
)

ROOT = Path(__file__).resolve().parents[1]
HOUR = 3600.0
DAY = 86400.0


def _events(job: Job, horizon: float, rows: list[tuple[int, float, int, int]]) -> FailureEvents:
    """Hand-made events: (seed, time, component code, component index)."""
    seeds = 1 + max((r[0] for r in rows), default=0)
    arr = np.array(rows, dtype=np.float64).reshape(-1, 4)
    return FailureEvents.from_unsorted(
        cluster=job.cluster,
        horizon_s=horizon,
        num_seeds=seeds,
        seed=arr[:, 0].astype(int),
        time_s=arr[:, 1],
        component=arr[:, 2].astype(int),
        index=arr[:, 3].astype(int),
    )


def _accounting_ok(result: SimulationResult) -> None:
    for r in result.strategies:
        total = r.goodput * r.horizon_s + sum(r.lost_s[c] for c in CAUSES)
        np.testing.assert_allclose(total, r.horizon_s, rtol=1e-9, err_msg=r.name)
        assert np.all((r.goodput >= 0) & (r.goodput <= 1))
        for cause in CAUSES:
            assert np.all(r.lost_s[cause] >= -1e-6 * r.horizon_s), (r.name, cause)


# ----------------------------------------------------------------- configs and bad input


def test_layout_parses_and_validates() -> None:
    assert Layout.parse("pp=16,dp=128,tp=8") == Layout(pp=16, dp=128, tp=8)
    assert Layout.parse(" dp=2, pp=4 ") == Layout(pp=4, dp=2, tp=1)
    assert str(Layout(pp=2, dp=3, tp=4)) == "pp=2,dp=3,tp=4"
    assert Layout.default_for(16_384).gpus == 16_384
    assert Layout.default_for(12).gpus == 12
    for bad in ("pp=16", "pp=2,dp=x", "pp=2,dp=2,ep=2", "pp=2,pp=2,dp=1", "16x128", "pp=0,dp=2"):
        with pytest.raises(ValueError, match=r"[lL]ayout"):
            Layout.parse(bad)


def test_job_layout_must_multiply_to_the_gpu_count() -> None:
    with pytest.raises(ValueError, match=r"pp \* dp \* tp must equal"):
        Job(gpus=16_000, layout=Layout(pp=16, dp=128, tp=8))
    with pytest.raises(ValueError, match="gpus_per_node"):
        Job(gpus=8, layout=Layout(pp=8, dp=1), gpus_per_node=0)


@pytest.mark.parametrize(
    "field", ["detect_s", "restart_s", "checkpoint_write_s", "approx_penalty_steps"]
)
def test_cost_model_rejects_negative_and_non_finite_values(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: -1.0})
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: float("inf")})
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: "1"})
    with pytest.raises(ValueError, match="transfer_bytes_per_s"):
        CostModel(transfer_bytes_per_s=0.0)


def test_cost_model_json_round_trip_and_partial_files(tmp_path: Path) -> None:
    costs = CostModel(detect_s=1.5, restart_s=42.0)
    path = tmp_path / "costs.json"
    costs.to_json(path)
    assert CostModel.from_json(path) == costs
    zero = tmp_path / "zero.json"
    CostModel.zero().to_json(zero)
    assert CostModel.from_json(zero) == CostModel.zero()
    path.write_text(json.dumps({"detect_s": 2.0, "_source": "bench.py on h100"}), encoding="utf-8")
    assert CostModel.from_json(path) == CostModel(detect_s=2.0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"detect": 1}', "unknown CostModel field"),
        ('{"detect_s": -3}', "detect_s"),
    ],
)
def test_bad_calibration_files_raise(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        CostModel.from_json(path)
    with pytest.raises(ValueError, match="cannot read"):
        CostModel.from_json(tmp_path / "absent.json")


def test_simulate_rejects_bad_arguments() -> None:
    job = Job(gpus=8, layout=Layout(pp=4, dp=2))
    model = ExponentialFailures(mtbf_hours=10.0)
    with pytest.raises(ValueError, match="horizon_s"):
        simulate(job, model, horizon_s=None)
    with pytest.raises(ValueError, match="horizon_s"):
        simulate(job, model, horizon_s=-1.0)
    with pytest.raises(ValueError, match="unknown strategy"):
        simulate(job, model, ["magic"], horizon_s=10.0)
    with pytest.raises(ValueError, match="unique"):
        simulate(job, model, ["replica_copy", "replica_copy"], horizon_s=10.0)
    other = model.sample(ClusterShape(gpus=16), 10.0)
    with pytest.raises(ValueError, match="drawn for"):
        simulate(job, other)
    with pytest.raises(ValueError, match="job_mtbf_s"):
        simulate(job, model, horizon_s=10.0, job_mtbf_s=0.0)
    with pytest.raises(ValueError, match="interval_s"):
        CheckpointRestart(interval_s=-5.0)
    with pytest.raises(ValueError, match="every_steps"):
        SnapshotPolicy(every_steps=0)
    with pytest.raises(ValueError, match="step_s"):
        simulate(job, model, ["replica_copy"], horizon_s=10.0, costs=CostModel(step_s=0.0))


# ----------------------------------------------------------------- analytic references


def test_checkpoint_interval_formulas() -> None:
    assert young_interval(60.0, 3 * HOUR) == pytest.approx(math.sqrt(2 * 60 * 3 * HOUR))
    c, m = 60.0, 3 * HOUR
    expected = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    assert daly_interval(c, m) == pytest.approx(expected)
    assert daly_interval(10.0, 4.0) == 4.0  # C >= 2M: checkpoint once per MTBF
    assert daly_waste(
        interval_s=100.0, checkpoint_s=0.01, restart_s=0.0, mtbf_s=1e7
    ) == pytest.approx(
        young_waste(interval_s=100.0, checkpoint_s=0.01, restart_s=0.0, mtbf_s=1e7), rel=1e-3
    )
    with pytest.raises(ValueError, match="mtbf_s"):
        young_interval(1.0, 0.0)


def test_mean_ci_uses_student_t() -> None:
    x = np.arange(10.0)
    m, _, hi = mean_ci(x)
    assert m == 4.5
    assert (hi - m) / (x.std(ddof=1) / math.sqrt(10)) == pytest.approx(2.2622, abs=2e-3)
    assert math.isnan(mean_ci(np.array([1.0]))[1])


# ----------------------------------------------------------------- validation (item 3)

_SINGLE = Job(gpus=1, layout=Layout(pp=1, dp=1), gpus_per_node=1)


def _checkpoint_waste(c: float, m: float, r: float, interval: float) -> float:
    costs = CostModel(checkpoint_write_s=c, detect_s=0.0, restart_s=r, checkpoint_load_s=0.0)
    result = simulate(
        _SINGLE,
        ExponentialFailures(mtbf_hours=m / HOUR),
        [CheckpointRestart(interval_s=interval)],
        horizon_s=1000 * m,
        seeds=20,
        seed=11,
        costs=costs,
        keep_events=False,
    )
    return 1.0 - float(result.strategies[0].goodput.mean())


@pytest.mark.parametrize("c", [10.0, 60.0, 300.0])
@pytest.mark.parametrize("m_hours", [3.0, 24.0, 96.0])
def test_checkpoint_restart_matches_daly(c: float, m_hours: float) -> None:
    m, r = m_hours * HOUR, 120.0
    t = daly_interval(c, m)
    simulated = _checkpoint_waste(c, m, r, t)
    assert simulated == pytest.approx(
        daly_waste(interval_s=t, checkpoint_s=c, restart_s=r, mtbf_s=m), rel=0.03
    )


@pytest.mark.parametrize(
    ("c", "m_hours", "r"),
    [
        (10.0, 3.0, 0.0),
        (10.0, 24.0, 120.0),
        (60.0, 24.0, 0.0),
        (60.0, 96.0, 120.0),
        (300.0, 96.0, 0.0),
    ],
)
def test_checkpoint_restart_matches_young_where_first_order_holds(
    c: float, m_hours: float, r: float
) -> None:
    # Young's first-order waste C/T + (T/2 + R)/M is within 3% of the exact waste while
    # C/M stays around 1e-3 or below; it overestimates beyond (8% at C/M = 0.03).
    m = m_hours * HOUR
    t = young_interval(c, m)
    simulated = _checkpoint_waste(c, m, r, t)
    assert simulated == pytest.approx(
        young_waste(interval_s=t, checkpoint_s=c, restart_s=r, mtbf_s=m), rel=0.03
    )


@pytest.mark.parametrize("name", list(POLICY_MODELS))
def test_zero_costs_give_goodput_one(name: str) -> None:
    job = Job(gpus=64, layout=Layout(pp=4, dp=2, tp=8))
    model = MixedFailures(
        (
            ExponentialFailures(mtbf_hours=5.0),
            ExponentialFailures(mtbf_hours=20.0, component="rack"),
        )
    )
    result = simulate(job, model, [name], horizon_s=10 * DAY, seeds=5, costs=CostModel.zero())
    assert result.failures_per_seed.mean() > 100
    np.testing.assert_allclose(result.strategies[0].goodput, 1.0, rtol=1e-12)


@pytest.mark.parametrize(("stages", "replicas", "window"), [(4, 2, 20.0), (4, 3, 60.0)])
def test_exhaustion_frequency_matches_the_closed_form(
    stages: int, replicas: int, window: float
) -> None:
    rate, horizon, seeds = 1e-3, 2e5, 30
    job = Job(
        gpus=stages * replicas,
        layout=Layout(pp=stages, dp=replicas),
        gpus_per_node=1,
        nodes_per_rack=1,
    )
    costs = CostModel(
        detect_s=window / 2, replace_warm_s=window / 2, reform_s=0.0, model_state_bytes=0.0
    )
    model = ExponentialFailures(mtbf_hours=1 / rate / HOUR)
    result = simulate(
        job, model, ["replica_copy"], horizon_s=horizon, seeds=seeds, seed=2, costs=costs
    )
    actions = result["replica_copy"].actions
    simulated = int((actions["fallback_rollback"] + actions["fallback_durable"]).sum())
    expected = seeds * expected_exhaustions(
        stages=stages, replicas=replicas, worker_rate_per_s=rate, window_s=window, horizon_s=horizon
    )
    assert abs(simulated - expected) < 4 * math.sqrt(expected)
    per_failure = simulated / result.failures_per_seed.sum()
    p = exhaustion_probability(replicas=replicas, worker_rate_per_s=rate, window_s=window)
    assert per_failure == pytest.approx(p, rel=4 / math.sqrt(expected))
    assert exhaustion_probability(replicas=1, worker_rate_per_s=rate, window_s=window) == 1.0


# ----------------------------------------------------------------- hand-checked scenarios


def test_hand_checked_single_failure() -> None:
    job = Job(gpus=6, layout=Layout(pp=3, dp=2), gpus_per_node=1, nodes_per_rack=1)
    horizon = 10_000.0
    events = _events(job, horizon, [(0, 1000.0, 0, 1)])  # worker 1 = stage 1 of replica 0
    costs = CostModel(
        detect_s=5.0, replace_warm_s=10.0, reform_s=5.0, model_state_bytes=0.0, restart_s=50.0,
        checkpoint_write_s=10.0, checkpoint_load_s=20.0, snapshot_write_s=0.0, step_s=1.0,
    )  # fmt: skip
    policy = SnapshotPolicy(every_steps=None, durable_every_s=None)
    strategies = [CheckpointRestart(interval_s=100.0), ReplicaCopy(snapshots=policy)]
    result = simulate(job, events, strategies, costs=costs)
    # checkpoint_restart: at q=1000 the last checkpoint ended at 9 * 110 = 990 (900 s of work);
    # the failure loses the 10 s of work since, then stalls 5 + 50 + 20 s.
    cr = result["checkpoint_restart"]
    q_end = 990 + (horizon - 1000 - 75)
    useful = (q_end // 110) * 100 + min(q_end % 110, 100)
    assert cr.goodput[0] == pytest.approx(useful / horizon)
    assert cr.lost_s["lost_work"][0] == pytest.approx(10.0)
    assert cr.lost_s["replacement"][0] == pytest.approx(50.0)
    assert cr.lost_s["transfer"][0] == pytest.approx(20.0)
    # replica_copy: a live replica exists; the job stalls 5 + 10 + 5 s and loses nothing else.
    rc = result["replica_copy"]
    assert rc.goodput[0] == pytest.approx((horizon - 20.0) / horizon)
    assert rc.events is not None
    assert rc.events.action_names[int(rc.events.action[0])] == "replica_copy"


def test_checkfree_handles_isolated_lost_stages_and_rolls_back_otherwise() -> None:
    # One replica, four stages, one GPU each: every failure loses a stage group.
    job = Job(gpus=4, layout=Layout(pp=4, dp=1), gpus_per_node=1, nodes_per_rack=2)
    horizon = 100_000.0
    rows = [
        (0, 50_500.0, 0, 1),  # middle stage: averaging
        (1, 50_500.0, 0, 0),  # first stage: checkfree rolls back, checkfree+ copies
        (2, 50_500.0, 0, 1),  # stages 1 and 2 within one window: adjacent
        (2, 50_501.0, 0, 2),
        (3, 50_500.0, 2, 0),  # a rack: stages 0 and 1, and each other's snapshot copies
    ]
    events = _events(job, horizon, rows)
    costs = CostModel(step_s=1.0, approx_penalty_steps=10.0, snapshot_write_s=0.0)
    policy = SnapshotPolicy(every_steps=1000, durable_every_s=None)
    result = simulate(
        job, events, [CheckFree(snapshots=policy), CheckFreePlus(snapshots=policy)], costs=costs
    )

    def actions(name: str, seed: int) -> list[str]:
        log = result[name].events
        assert log is not None
        return [log.action_names[a] for a in log.action[log.seed == seed]]

    assert actions("checkfree", 0) == ["approximate"]
    assert actions("checkfree+", 0) == ["approximate"]
    assert actions("checkfree", 1) == ["fallback_rollback"]
    assert actions("checkfree+", 1) == ["approximate"]
    assert actions("checkfree", 2)[1] == "fallback_rollback"
    assert actions("checkfree+", 2)[1] == "fallback_rollback"
    assert actions("checkfree+", 3) == ["fallback_durable"]
    cf = result["checkfree+"]
    assert cf.lost_s["convergence"][0] == pytest.approx(10.0)
    assert cf.lost_s["convergence"][1] == pytest.approx(10.0)


def test_approximation_declined_when_the_snapshot_is_more_recent() -> None:
    job = Job(gpus=4, layout=Layout(pp=4, dp=1), gpus_per_node=1)
    events = _events(job, 10_000.0, [(0, 1005.0, 0, 1)])  # 5 s after a snapshot
    costs = CostModel(step_s=1.0, approx_penalty_steps=50.0, snapshot_write_s=0.0)
    policy = SnapshotPolicy(every_steps=100, durable_every_s=None)
    result = simulate(job, events, [CheckFree(snapshots=policy)], costs=costs)
    r = result["checkfree"]
    assert r.actions["approximate_declined"][0] == 1
    assert r.lost_s["convergence"][0] == 0.0
    assert r.lost_s["exhausted"][0] > 0


def test_peer_snapshot_falls_back_when_a_node_and_its_partner_die() -> None:
    # pp * tp = 16 GPUs = two nodes per replica: node n keeps its snapshot copy on node n + 2.
    job = Job(gpus=64, layout=Layout(pp=4, dp=4, tp=4), gpus_per_node=8, nodes_per_rack=1)
    assert job.partner_offset == 2
    rows = [
        (0, 1000.0, 1, 0),
        (0, 1010.0, 1, 2),
        (1, 1000.0, 1, 0),
        (1, 1010.0, 1, 1),
        (2, 1000.0, 0, 0),
        (2, 1010.0, 0, 16),
    ]
    result = simulate(job, _events(job, 5000.0, rows), [PeerSnapshot()])
    acts = result["peer_snapshot"].actions
    assert acts["fallback_durable"].tolist() == [1, 0, 0]
    assert acts["rollback"].tolist() == [1, 2, 2]


# ----------------------------------------------------------------- strategy conformance


_SLOW_COPY = CostModel(
    model_state_bytes=1e15, model_weight_bytes=1e14, transfer_bytes_per_s=1e9,
    snapshot_load_s=1.0, checkpoint_load_s=2.0, restart_s=3.0,
)  # fmt: skip
"""Costs under which copying a replica's state (10^15 B at 1 GB/s) takes far longer than any
load or restart, so a fallback that forgot the path it tried first would look cheaper."""


def _primary_path_s(name: str, job: Job, c: CostModel) -> float:
    """Stall of a strategy's action when a replica of every stage lives, from the costs."""
    if name == "checkpoint_restart":  # every failure restarts the job from the checkpoint
        return c.detect_s + c.restart_s + c.checkpoint_load_s
    replace = c.replace_warm_s + c.reform_s  # a warm spare joins, the groups re-form
    if name == "peer_snapshot":  # every worker reloads its in-memory snapshot
        return c.detect_s + replace + c.snapshot_load_s
    # the others copy a live replica's state, each GPU its 1 / (pp * tp) shard in parallel
    shard = c.model_state_bytes / (job.layout.pp * job.layout.tp)
    return c.detect_s + replace + shard / c.transfer_bytes_per_s


@pytest.mark.parametrize("name", list(POLICY_MODELS))
def test_strategy_conformance(name: str) -> None:
    strategy = make_policy_model(name)
    assert isinstance(strategy, PolicyModel) and strategy.name == name
    job = Job(gpus=48, layout=Layout(pp=3, dp=2, tp=8), gpus_per_node=8, nodes_per_rack=2)
    ctx = SimContext(job=job, costs=CostModel(), horizon_s=30 * DAY, job_mtbf_s=5 * HOUR)
    kinds = strategy.kinds(ctx)
    assert kinds and len({k.name for k in kinds}) == len(kinds)
    if strategy.exact:
        assert all(k.effect in ("stall", "rollback") for k in kinds)
    # kinds[0] is what the strategy does while a replica of every stage lives; its cost is
    # the formula below, written from the cost model, not from the strategy. No other
    # action may be cheaper, also where the raw fallback phases (a snapshot or checkpoint
    # load) are cheaper than moving a replica's state: then the fallback still pays the
    # path it tried first.
    for costs in (ctx.costs, _SLOW_COPY):
        c = SimContext(job=job, costs=costs, horizon_s=ctx.horizon_s, job_mtbf_s=ctx.job_mtbf_s)
        kinds_c = strategy.kinds(c)
        primary = _primary_path_s(name, job, costs)
        assert kinds_c[0].total_s == pytest.approx(primary), (name, kinds_c[0])
        cheaper = [k.name for k in kinds_c[1:] if k.total_s < primary * (1 - 1e-12)]
        assert not cheaper, f"{name}: {cheaper} cost less than the primary path {primary} s"
    model = MixedFailures(
        (
            ExponentialFailures(mtbf_hours=50.0),
            ExponentialFailures(mtbf_hours=200.0, component="rack"),
        )
    )
    events = model.sample(job.cluster, 30 * DAY, seeds=4)
    window = strategy.down_window_s(ctx)
    if window is not None:
        facts = classify_events(events, job, window)
        plan = strategy.plan(facts, ctx)
        assert plan.kind.shape == (len(events),)
        assert plan.kind.min() >= 0 and plan.kind.max() < len(kinds)
    result = simulate(job, events, [strategy])
    _accounting_ok(result)
    r = result.strategies[0]
    assert r.exact == strategy.exact
    assert sum(int(v.sum()) for v in r.actions.values()) == len(events)
    if strategy.exact:
        assert np.all(r.lost_s["convergence"] == 0)


def test_unknown_strategy_options_raise() -> None:
    with pytest.raises(ValueError, match="bad options"):
        make_policy_model("replica_copy", spares=3)


# ----------------------------------------------------------------- properties

_layouts = st.tuples(st.integers(1, 5), st.integers(1, 3), st.sampled_from([1, 2, 4]))


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[Job, FailureEvents, CostModel, list[PolicyModel]]:
    pp, dp, tp = draw(_layouts)
    job = Job(
        gpus=pp * dp * tp,
        layout=Layout(pp=pp, dp=dp, tp=tp),
        gpus_per_node=draw(st.sampled_from([1, 2, 4, 8])),
        nodes_per_rack=draw(st.integers(1, 3)),
    )
    model = MixedFailures(
        (
            ExponentialFailures(mtbf_hours=draw(st.floats(0.5, 50.0))),
            ExponentialFailures(mtbf_hours=draw(st.floats(2.0, 200.0)), component="node"),
            ExponentialFailures(mtbf_hours=draw(st.floats(5.0, 500.0)), component="rack"),
        )
    )
    events = model.sample(
        job.cluster, draw(st.floats(1e4, 2e5)), seeds=3, seed=draw(st.integers(0, 2**16))
    )
    scale = draw(st.floats(0.0, 3.0))
    base = CostModel().to_dict()
    costs = CostModel.from_dict(
        {k: v * scale for k, v in base.items() if k not in ("transfer_bytes_per_s", "step_s")}
        | {"step_s": draw(st.floats(0.5, 20.0)), "transfer_bytes_per_s": draw(st.floats(1e8, 1e11))}
    )
    every = draw(st.one_of(st.none(), st.integers(1, 300)))
    durable = draw(st.one_of(st.none(), st.floats(600.0, 30_000.0)))
    policy = SnapshotPolicy(every_steps=every, durable_every_s=durable)
    warm = draw(st.booleans())
    strategies: list[PolicyModel] = [
        CheckpointRestart(formula=draw(st.sampled_from(["daly", "young"]))),
        PeerSnapshot(snapshots=policy, warm_spares=warm),
        ReplicaCopy(snapshots=policy, warm_spares=warm),
        CheckFree(snapshots=policy, warm_spares=warm),
        CheckFreePlus(snapshots=policy, warm_spares=warm),
        EmbeddingPartial(snapshots=policy, warm_spares=warm),
    ]
    return job, events, costs, strategies


@settings(max_examples=40, deadline=None)
@given(scenario=_scenarios())
def test_goodput_is_a_fraction_and_lost_time_adds_up(scenario) -> None:
    job, events, costs, strategies = scenario
    result = simulate(job, events, strategies, costs=costs)
    _accounting_ok(result)
    for r in result.strategies:
        if r.exact:
            assert np.all(r.lost_s["convergence"] == 0), r.name


@settings(max_examples=60, deadline=None)
@given(scenario=_scenarios(), keep=st.floats(0.05, 0.95), thin_seed=st.integers(0, 2**16))
def test_more_failures_never_raise_goodput(scenario, keep: float, thin_seed: int) -> None:
    # Common random numbers: the thinned run sees a subset of the same seed's failures.
    job, events, costs, strategies = scenario
    fewer = events.select(np.random.default_rng(thin_seed).uniform(size=len(events)) < keep)
    mtbf = 3600.0  # the same checkpoint interval for both runs
    more_result = simulate(job, events, strategies, costs=costs, job_mtbf_s=mtbf)
    fewer_result = simulate(job, fewer, strategies, costs=costs, job_mtbf_s=mtbf)
    for more, less in zip(more_result.strategies, fewer_result.strategies, strict=True):
        assert np.all(less.goodput >= more.goodput - 1e-9), (more.name, more.goodput, less.goodput)


def _classify_reference(
    events: FailureEvents, job: Job, window: float
) -> tuple[list, list, list, list]:
    """Brute force: rebuild the down sets of every event from scratch."""
    s_count, r_count, tp, gpn = job.layout.pp, job.layout.dp, job.layout.tp, job.gpus_per_node
    nodes, off = job.cluster.nodes, job.partner_offset
    lost, adjacent, edge, tier = [], [], [], []
    for i in range(len(events)):
        window_ev = [
            j for j in range(i + 1)
            if events.seed[j] == events.seed[i] and (j == i or events.time_s[j] > events.time_s[i] - window)
        ]  # fmt: skip

        def workers(j: int) -> range:
            return range(
                events.first_gpu[j] // tp, (events.first_gpu[j] + events.num_gpus[j] - 1) // tp + 1
            )

        def hosts(j: int) -> range:
            return range(
                events.first_gpu[j] // gpn,
                (events.first_gpu[j] + events.num_gpus[j] - 1) // gpn + 1,
            )

        down = {w for j in window_ev for w in workers(j)}

        def gone(s: int) -> bool:
            return 0 <= s < s_count and all(r * s_count + s in down for r in range(r_count))  # noqa: B023

        mine = sorted({w % s_count for w in workers(i)})
        lost_here = [s for s in mine if gone(s)]
        lost.append(len(lost_here))
        adjacent.append(any(gone(s - 1) or gone(s + 1) for s in lost_here))
        edge.append(any(s in (0, s_count - 1) for s in lost_here))
        if events.component[i] == 0:
            tier.append(False)
        else:
            dead = {v for j in window_ev if events.component[j] > 0 for v in hosts(j)}
            tier.append(
                off == 0
                or any((v + off) % nodes in dead or (v - off) % nodes in dead for v in hosts(i))
            )
    return lost, adjacent, edge, tier


@settings(max_examples=80, deadline=None)
@example(layout=(2, 1, 1), gpn=1, npr=2, window=0.0, seed=0)
@given(
    layout=_layouts,
    gpn=st.sampled_from([1, 2, 4, 8]),
    npr=st.integers(1, 3),
    window=st.floats(0.0, 400.0),
    seed=st.integers(0, 2**16),
)
def test_vectorised_classification_matches_brute_force(
    layout, gpn: int, npr: int, window: float, seed: int
) -> None:
    pp, dp, tp = layout
    job = Job(
        gpus=pp * dp * tp, layout=Layout(pp=pp, dp=dp, tp=tp), gpus_per_node=gpn, nodes_per_rack=npr
    )
    model = MixedFailures(
        (
            ExponentialFailures(mtbf_hours=0.5),
            ExponentialFailures(mtbf_hours=1.0, component="node"),
            ExponentialFailures(mtbf_hours=3.0, component="rack"),
        )
    )
    events = model.sample(job.cluster, 4 * HOUR, seeds=2, seed=seed)
    facts = classify_events(events, job, window)
    lost, adjacent, edge, tier = _classify_reference(events, job, window)
    assert facts.lost_stages.tolist() == lost
    assert facts.adjacent.tolist() == adjacent
    assert facts.edge.tolist() == edge
    assert facts.tier_lost.tolist() == tier


# ----------------------------------------------------------------- seeds, sweeps, traces


def test_split_seed_chunks_merge_to_the_whole_run() -> None:
    job = Job(gpus=256, layout=Layout(pp=4, dp=8, tp=8))
    scenario = Scenario(
        job=job, failures=llama3_failures(), horizon_s=30 * DAY, seeds=6, seed=4, keep_events=True
    )
    whole = scenario.run()
    merged = SimulationResult.merge(sweep(scenario.split(4)))
    assert merged.num_seeds == 6
    for a, b in zip(whole.strategies, merged.strategies, strict=True):
        np.testing.assert_array_equal(a.goodput, b.goodput)
        assert a.events is not None and b.events is not None
        np.testing.assert_array_equal(a.events.seed, b.events.seed)
        np.testing.assert_array_equal(a.events.action, b.events.action)


def test_replayed_trace_drives_the_simulator(tmp_path: Path) -> None:
    job = Job(gpus=128, layout=Layout(pp=4, dp=4, tp=8))
    path = tmp_path / "trace.csv"
    path.write_text("time_s,component\n3600,gpu:5\n7200,node:3\n7230,node:7\n", encoding="utf-8")
    from simulations.traces import TraceReplay

    replay = TraceReplay.from_csv(path, duration_s=DAY, random_offset=False)
    result = simulate(job, replay, horizon_s=DAY, seeds=2)
    assert result.failures_per_seed.tolist() == [3, 3]
    assert np.all(result["checkpoint_restart"].goodput < result["replica_copy"].goodput)


class _GetTimeoutError(TimeoutError):
    pass


class _FakeRay(ModuleType):
    """Just enough of Ray's API for :func:`sweep`: tasks run when their result is fetched."""

    def __init__(self, *, hang: bool = False) -> None:
        super().__init__("ray")
        self.exceptions = ModuleType("ray.exceptions")
        self.exceptions.GetTimeoutError = _GetTimeoutError  # type: ignore[attr-defined]
        self.hang, self.inits, self.cancelled = hang, [], 0

    def is_initialized(self) -> bool:
        return bool(self.inits)

    def init(self, **kwargs: object) -> None:
        self.inits.append(kwargs)

    def remote(self, fn):
        return SimpleNamespace(remote=lambda *args: (fn, args))

    def get(self, refs, timeout: float):
        if self.hang:
            raise _GetTimeoutError(f"timed out after {timeout}")
        return [fn(*args) for fn, args in refs]

    def cancel(self, ref, force: bool) -> None:
        self.cancelled += 1


def _use_fake_ray(monkeypatch: pytest.MonkeyPatch, fake: _FakeRay) -> None:
    """Put ``fake`` in place of Ray, also where recovery.groups.ray_env (imported by an earlier
    test, or not) already holds the real module."""
    import recovery.groups.ray_env

    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.exceptions", fake.exceptions)
    monkeypatch.setattr(recovery.groups.ray_env, "ray", fake)
    monkeypatch.setattr(recovery.groups.ray_env, "_quiet_expected_deaths", lambda: None)


def test_sweep_fans_out_through_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(gpus=64, layout=Layout(pp=4, dp=2, tp=8))
    scenario = Scenario(job=job, failures=llama3_failures(), horizon_s=10 * DAY, seeds=4)
    fake = _FakeRay()
    _use_fake_ray(monkeypatch, fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    on_ray = SimulationResult.merge(sweep(scenario.split(2), use_ray=True))
    assert fake.inits and fake.inits[0]["address"] == "local"  # never someone else's Ray
    for a, b in zip(scenario.run().strategies, on_ray.strategies, strict=True):
        np.testing.assert_array_equal(a.goodput, b.goodput)
    stuck = _FakeRay(hang=True)
    _use_fake_ray(monkeypatch, stuck)
    with pytest.raises(TimeoutError, match="did not finish"):
        sweep(scenario.split(2), use_ray=True, timeout=timedelta(seconds=1))
    assert stuck.cancelled == 2


# ----------------------------------------------------------------- command line


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"_script_{name}", ROOT / "scripts" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_simulate_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli = _script("simulate")
    calib = tmp_path / "calib.json"
    CostModel(detect_s=3.0).to_json(calib)
    argv = [
        "--gpus", "1024", "--days", "5", "--layout", "pp=8,dp=16,tp=8", "--mtbf-hours", "20000",
        "--node-mtbf-hours", "30000", "--strategies", "checkpoint_restart,replica_copy,checkfree+",
        "--seeds", "6", "--calibration", str(calib), "--set", "restart_s=600", "--quiet",
        "--plot", str(tmp_path / "g.png"), "--json", str(tmp_path / "g.json"), "--events", str(tmp_path / "e.csv"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "checkpoint_restart" in out and "goodput" in out and "95% CI" in out
    summary = json.loads((tmp_path / "g.json").read_text())
    assert set(summary["strategies"]) == {"checkpoint_restart", "replica_copy", "checkfree+"}
    assert summary["seeds"] == 6
    assert (tmp_path / "g.png").stat().st_size > 1000
    assert (tmp_path / "e.csv").read_text().startswith("strategy,seed,time_s")


def test_simulate_cli_weibull_and_correlated_failures(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "512", "--days", "3", "--weibull-shape", "0.7", "--mtbf-hours", "5000", "--rack-mtbf-hours", "20000",
            "--snapshot-every-steps", "none", "--durable-every-hours", "1", "--cold-spares", "--seeds", "3", "--quiet"]  # fmt: skip
    assert _script("simulate").main(argv) == 0
    out = capsys.readouterr().out
    assert "Weibull k=0.7" in out and "rack MTBF" in out and "checkpoint every 3,600 s" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "1000", "--layout", "pp=16,dp=128,tp=8"], "must equal"),
        (["--gpus", "64", "--mtbf-hours", "-5"], "mtbf_hours"),
        (["--gpus", "64", "--strategies", "magic"], "unknown strategy"),
        (["--gpus", "64", "--set", "detect=1"], "bad --set"),
        (["--gpus", "64", "--set", "checkpoint_save_s=1"], "'checkpoint_save_s' is now"),
    ],
)
def test_simulate_cli_reports_bad_input(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _script("simulate").main([*argv, "--quiet", "--seeds", "2", "--days", "1"]) == 2
    assert message in capsys.readouterr().err


def test_simulate_cli_rejects_a_malformed_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time_s,component\n12,gpu\n", encoding="utf-8")
    assert _script("simulate").main(["--gpus", "64", "--trace", str(path), "--quiet"]) == 2
    assert "line 2" in capsys.readouterr().err


def test_bench_simulator_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert _script("bench_simulator").main(["--seeds", "2", "--days", "0.5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "100,000 GPUs" in out and "budget" in out
