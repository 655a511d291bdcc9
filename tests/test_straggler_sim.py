"""Stragglers in the cluster simulator (`simulations.stragglers`): the arithmetic on cases
small enough to check by hand, the closed form for many, mitigation against none, a zero
rate changing nothing, and the ``simulate`` command's flags."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulations.cli import simulate as cli
from simulations.cluster import Job, Layout, Scenario, SimulationResult, simulate
from simulations.costs import CostModel
from simulations.stragglers import StragglerDraws, StragglerModel, WorkClock
from simulations.traces import ExponentialFailures, llama3_failures

JOB = Job(gpus=64, layout=Layout(pp=4, dp=2, tp=8))
H = 100 * 3600.0
STEP = 6.0
NEVER = ExponentialFailures(mtbf_hours=math.inf)
FREE = dataclasses.replace(CostModel.zero(), step_s=STEP)
"""Every recovery free: what is lost is the slow pace alone."""


def _draws(onsets: list[float], durations: list[float], *, factor: float = 3.0) -> StragglerDraws:
    n = len(onsets)
    return StragglerDraws(
        job=JOB,
        horizon_s=H,
        num_seeds=1,
        factor=factor,
        patience_steps=20,
        seed=np.zeros(n, dtype=np.int64),
        onset_s=np.array(onsets),
        worker=np.arange(n) % JOB.layout.workers,
        duration_s=np.array(durations),
    )


def _run(draws: StragglerDraws, mitigate: bool, costs: CostModel = FREE) -> SimulationResult:
    return simulate(
        JOB,
        NEVER,
        ["replica_copy", "checkpoint_restart"],
        horizon_s=H,
        costs=costs,
        seeds=1,
        stragglers=draws,
        mitigate_stragglers=mitigate,
    )


def test_one_straggler_left_slow_costs_two_thirds_of_its_duration() -> None:
    """A 3x straggler for T: the job does T/3 of work in T, so 2T/3 is lost."""
    t = 10 * 3600.0
    result = _run(_draws([1000.0], [t]), mitigate=False)
    for r in result.strategies:
        assert r.goodput[0] == pytest.approx(1 - (2 * t / 3) / H, abs=1e-12)
        assert r.lost_s["slow"][0] == pytest.approx(2 * t / 3)


def test_one_straggler_mitigated_costs_its_patience_and_the_replacement() -> None:
    """Detected after 20 steps at 3x (360 s of wall time, 120 s of work: 240 s lost),
    then replaced from a warm spare: detect + warm start + re-form, a free transfer."""
    costs = dataclasses.replace(FREE, detect_s=10.0, replace_warm_s=10.0, reform_s=15.0)
    costs = dataclasses.replace(costs, transfer_bytes_per_s=math.inf)
    result = _run(_draws([1000.0], [10 * 3600.0]), mitigate=True, costs=costs)
    r = result["replica_copy"]
    assert r.goodput[0] == pytest.approx(1 - (20 * STEP * 2 + 35.0) / H, abs=1e-12)
    assert r.lost_s["slow"][0] == pytest.approx(240.0)
    assert r.actions["replica_copy"][0] == 1
    assert result.stragglers_handled_per_seed is not None
    assert result.stragglers_handled_per_seed[0] == 1


def test_a_straggler_gone_before_its_patience_is_never_replaced() -> None:
    short = _draws([1000.0], [100.0])  # under the 360 s it takes to be detected
    slow, fixed = _run(short, mitigate=False), _run(short, mitigate=True)
    for a, b in zip(slow.strategies, fixed.strategies, strict=True):
        assert a.goodput[0] == b.goodput[0] == pytest.approx(1 - (2 * 100.0 / 3) / H, abs=1e-12)
        assert sum(v[0] for v in b.actions.values()) == 0


def test_overlapping_stragglers_slow_the_job_once() -> None:
    """Two 3x stragglers over [0, 2h) and [1h, 3h): slow 3 h in all, not 4."""
    clock = _draws([0.0, 3600.0], [7200.0, 7200.0]).clock(STEP, mitigated=False)
    assert clock.slow_seconds(1)[0] == pytest.approx(3 * 3600.0)
    t = np.array([[1800.0], [3 * 3600.0], [H - 1]])
    assert clock(t)[:, 0] == pytest.approx([600.0, 3600.0, H - 1 - 2 * 3600.0])
    result = _run(_draws([0.0, 3600.0], [7200.0, 7200.0]), mitigate=False)
    assert result["replica_copy"].goodput[0] == pytest.approx(1 - 2 * 3600.0 / H, abs=1e-12)


def test_the_work_clock_is_the_wall_clock_in_a_seed_without_stragglers() -> None:
    clock = WorkClock.from_intervals(
        3, np.array([1]), np.array([10.0]), np.array([40.0]), 3.0, 100.0
    )
    t = np.array([[5.0, 25.0, 99.5]])
    work = clock(t)[0]
    assert work[0] == 5.0 and work[2] == 99.5  # exactly: seeds 0 and 2 have none
    assert work[1] == pytest.approx(25.0 - (2 / 3) * 15.0)


def test_the_unmitigated_loss_matches_the_closed_form() -> None:
    """Poisson onsets at rate L, exponential durations of mean m: some straggler is slow
    a fraction ``1 - exp(-L m)`` of the time (M/G/inf), so goodput is ``1 - (1 - 1/f)``
    times that, up to the start-up transient and Monte Carlo noise."""
    model = StragglerModel(rate_per_gpu_hour=0.5 / 64, factor=3.0, mean_hours=1.0)
    result = simulate(
        JOB, NEVER, ["replica_copy"], horizon_s=H * 10, costs=FREE, seeds=8, stragglers=model
    )
    expected = 1 - (2 / 3) * (1 - math.exp(-0.5))
    assert result["replica_copy"].goodput.mean() == pytest.approx(expected, abs=0.01)


@settings(max_examples=15, deadline=None)
@given(
    rate=st.floats(1e-4, 3e-3),
    factor=st.floats(1.05, 5.0),
    mean_hours=st.sampled_from([0.01, 0.2, 1.0, 5.0, math.inf]),
    patience=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_mitigation_is_never_worse_than_none_when_replacement_is_free(
    rate: float, factor: float, mean_hours: float, patience: int, seed: int
) -> None:
    """Per seed, under failures and snapshot costs: replacing a straggler only ever cuts
    its slow time short, so with free replacements it can never lose goodput -- for the
    strategies that replace without rolling back (peer_snapshot rolls every worker back
    to its snapshot, so a replacement costs it the work since then)."""
    model = StragglerModel(
        rate_per_gpu_hour=rate, factor=factor, mean_hours=mean_hours, patience_steps=patience
    )
    costs = dataclasses.replace(FREE, snapshot_write_s=1.0, checkpoint_write_s=5.0)
    slow, fixed = (
        simulate(
            JOB,
            ExponentialFailures(mtbf_hours=2000.0),
            ["replica_copy", "checkfree+"],
            horizon_s=H,
            costs=costs,
            seeds=3,
            seed=seed,
            stragglers=model,
            mitigate_stragglers=m,
        )
        for m in (False, True)
    )
    for a, b in zip(slow.strategies, fixed.strategies, strict=True):
        assert np.all(b.goodput >= a.goodput - 1e-12), a.name


def test_a_zero_rate_changes_nothing() -> None:
    job = Job(gpus=1024, layout=Layout.parse("pp=8,dp=16,tp=8"))
    args = {"horizon_s": 5 * 86400.0, "seeds": 4, "keep_events": False}
    plain = simulate(job, llama3_failures(), **args)
    for mitigate in (False, True):
        zero = simulate(
            job,
            llama3_failures(),
            **args,
            stragglers=StragglerModel(rate_per_gpu_hour=0.0),
            mitigate_stragglers=mitigate,
        )
        assert zero.table() == plain.table()
        assert zero.to_dict() == plain.to_dict()
        for a, b in zip(plain.strategies, zero.strategies, strict=True):
            assert np.array_equal(a.goodput, b.goodput)
            assert a.lost_s.keys() == b.lost_s.keys()
            assert all(np.array_equal(a.lost_s[c], b.lost_s[c]) for c in a.lost_s)


def test_stragglers_keep_the_books_and_split_into_chunks_exactly() -> None:
    """Useful time plus every cause (``slow`` included) is the horizon; a run split into
    seed chunks gives the whole run's numbers (each seed has its own straggler stream)."""
    job = Job(gpus=1024, layout=Layout.parse("pp=8,dp=16,tp=8"))
    scenario = Scenario(
        job=job,
        failures=llama3_failures(),
        horizon_s=5 * 86400.0,
        seeds=4,
        stragglers=StragglerModel(rate_per_gpu_hour=1e-4),
        mitigate_stragglers=True,
    )
    whole = scenario.run()
    parts = SimulationResult.merge([s.run() for s in scenario.split(3)])
    for a, b in zip(whole.strategies, parts.strategies, strict=True):
        assert np.allclose(a.goodput, b.goodput, rtol=0, atol=1e-12)
        books = a.goodput * a.horizon_s + sum(a.lost_s.values())
        assert np.allclose(books, a.horizon_s)
    assert whole.stragglers_per_seed is not None and parts.stragglers_per_seed is not None
    assert np.array_equal(whole.stragglers_per_seed, parts.stragglers_per_seed)


def test_bad_straggler_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="factor"):
        StragglerModel(factor=0.5)
    with pytest.raises(ValueError, match="rate_per_gpu_hour"):
        StragglerModel(rate_per_gpu_hour=-1.0)
    with pytest.raises(ValueError, match="patience_steps"):
        StragglerModel(patience_steps=0)
    with pytest.raises(ValueError, match="workers"):
        dataclasses.replace(_draws([1.0], [1.0]), worker=np.array([99]))


SMALL = ["--gpus", "64", "--layout", "pp=2,dp=4,tp=8", "--days", "2", "--seeds", "3",
         "--strategies", "checkpoint_restart,replica_copy", "--quiet"]  # fmt: skip


def test_simulate_prints_the_straggler_table_and_its_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.json"
    argv = [*SMALL, "--straggler-rate", "1e-3", "--straggler-factor", "2",
            "--straggler-hours", "inf", "--straggler-patience", "5", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "2x slower, slow until handled, mitigated after 5 slow steps" in printed
    assert "unmitigated" in printed and "mitigation" in printed
    summary = json.loads(out.read_text())["stragglers"]
    assert summary["model"]["factor"] == 2.0 and math.isinf(summary["model"]["mean_hours"])
    for name in ("checkpoint_restart", "replica_copy"):
        assert summary["mitigated"][name]["goodput"] > summary["unmitigated"][name]["goodput"]


def test_simulate_with_a_zero_straggler_rate_prints_todays_output(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first table is the same with stragglers on; a zero rate drops the second."""
    assert cli.main([*SMALL, "--straggler-rate", "0"]) == 0
    plain = capsys.readouterr().out
    assert "straggler" not in plain
    assert cli.main(SMALL) == 0
    with_slow = capsys.readouterr().out
    assert with_slow.startswith(plain) and "slow episodes per seed" in with_slow


def test_simulate_refuses_bad_straggler_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*SMALL, "--straggler-factor", "0.5"]) == 2
    assert "factor" in capsys.readouterr().err


def test_simulate_help_names_the_straggler_flags_and_their_sources(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--straggler-rate",
        "--straggler-factor",
        "--straggler-hours",
        "--straggler-patience",
    ):
        assert flag in text
    assert "an assumption" in text and "2410.12588" in text
