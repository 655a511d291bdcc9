"""Tests of the in-process convergence simulator (`simulations.convergence`) and of the
experiment driver (`scripts/experiment.py`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from recovery.strategies import CheckFreeConfig
from simulations.convergence import (
    ConvergenceExperiment,
    ConvergencePolicy,
    ConvergenceSetup,
    EvalRecord,
    FailureProcess,
    PipelineTrainer,
    RunResult,
    ScheduledFailures,
    TimeModel,
    auto_target,
    run_convergence,
    summarize,
    time_to_target,
)

ROOT = Path(__file__).resolve().parent.parent

SETUP = ConvergenceSetup(
    preset="tiny",
    stages=4,
    microbatches=2,
    microbatch_size=2,
    max_bytes=1_000_000,
    eval_batches=1,
    warmup_steps=2,
)
TIMES = TimeModel(
    step_s=100.0,
    recovery_s=5.0,
    checkpoint_write_s=10.0,
    checkpoint_load_s=50.0,
    failover_s=7.0,
    redundant_factor=1.5,
)


@pytest.fixture(scope="module")
def baseline() -> RunResult:
    """A 6-step no-failure run, evaluated every 2 steps."""
    return run_convergence(
        SETUP,
        ConvergencePolicy(kind="none"),
        FailureProcess(hourly_rate=0.0),
        TIMES,
        steps=6,
        eval_every=2,
    )


# ---- failure process ----------------------------------------------------------------------


def test_failure_probability_and_common_random_numbers() -> None:
    low, high = FailureProcess(hourly_rate=0.05, seed=3), FailureProcess(hourly_rate=0.3, seed=3)
    assert low.probability(3600.0) == pytest.approx(0.05)
    assert low.probability(120.0) == pytest.approx(1 - 0.95 ** (120 / 3600))
    assert np.array_equal(low.uniforms(7, 4), high.uniforms(7, 4))  # common random numbers
    assert not np.array_equal(low.uniforms(7, 4), FailureProcess(hourly_rate=0.05).uniforms(7, 4))
    for attempt in range(300):
        assert set(low.failed(attempt, 4, 600.0)) <= set(high.failed(attempt, 4, 600.0))
    # A slower step (redundant computation) fails on a superset of attempts too.
    assert all(set(high.failed(a, 4, 600.0)) <= set(high.failed(a, 4, 900.0)) for a in range(300))
    assert FailureProcess(hourly_rate=0.0).failed(0, 4, 1e9) == []
    for bad in (-0.1, 1.0, True):
        with pytest.raises(ValueError, match="hourly_rate must be in"):
            FailureProcess(hourly_rate=bad)


def test_strategy_parsing_and_validation() -> None:
    assert ConvergencePolicy.parse("checkpoint:50").name == "checkpoint-50"
    cf = ConvergencePolicy.parse("checkfree+", averaging="uniform", label="cf+ uniform")
    assert cf.plus and cf.name == "cf+ uniform" and cf.checkfree.averaging.value == "uniform"  # type: ignore[union-attr]
    assert ConvergencePolicy.parse("checkfree:100").checkpoint_every == 100
    assert (
        ConvergencePolicy.parse("redundant").exact
        and not ConvergencePolicy.parse("checkfree").exact
    )
    with pytest.raises(ValueError, match="unknown strategy kind 'bamboo'"):
        ConvergencePolicy.parse("bamboo")
    with pytest.raises(ValueError, match="needs checkpoint_every"):
        ConvergencePolicy.parse("checkpoint")
    with pytest.raises(ValueError, match="bad checkpoint interval"):
        ConvergencePolicy.parse("checkpoint:often")
    with pytest.raises(ValueError, match="unknown CheckFree knob"):
        ConvergencePolicy.parse("checkfree", lr=2.0)
    with pytest.raises(ValueError, match="CheckFree knobs given to strategy 'checkpoint'"):
        ConvergencePolicy(
            kind="checkpoint", checkpoint_every=5, checkfree=CheckFreeConfig(lr_scale=2.0)
        )
    with pytest.raises(ValueError, match="swap_every is a CheckFree\\+ knob"):
        ConvergencePolicy.parse("checkfree", swap_every=4)
    quarter = PipelineTrainer(dataclasses.replace(SETUP, microbatches=4), plus=True, swap_every=4)
    assert quarter.routes == ((0, 1, 2, 3),) * 3 + ((1, 0, 3, 2),)
    with pytest.raises(ValueError, match="microbatches must be even"):
        ConvergenceSetup(microbatches=3)
    with pytest.raises(ValueError, match="redundant_factor must be >= 1"):
        TimeModel(redundant_factor=0.5)


def test_time_to_target_interpolates_and_auto_target() -> None:
    records = [
        EvalRecord(step=0, time_s=0.0, val_loss=5.0),
        EvalRecord(step=10, time_s=100.0, val_loss=3.0),
        EvalRecord(step=20, time_s=200.0, val_loss=2.0),
    ]
    assert time_to_target(records, 2.5) == pytest.approx(150.0)
    assert time_to_target(records, 6.0) == 0.0
    assert time_to_target(records, 1.0) is None
    run = RunResult(strategy="none", rate=0.0, seed=0, steps=20, step_s=10.0, records=records)
    assert auto_target(run, 0.5) == 3.0 and auto_target(run, 1.0) == 2.0


# ---- exact strategies and the timeline ------------------------------------------------------


def test_exact_strategies_replay_a_run_that_never_failed(baseline: RunResult) -> None:
    """Rollback + redo gives bit-identical losses; the replay on the baseline is the same."""
    kills = ScheduledFailures(kills={3: (2,), 5: (0, 3)}, hourly_rate=0.5)
    literal = run_convergence(
        SETUP, ConvergencePolicy.parse("checkpoint:2"), kills, TIMES, steps=6, eval_every=2
    )
    derived = run_convergence(
        SETUP, ConvergencePolicy.parse("checkpoint:2"), kills, TIMES, steps=6, eval_every=2,
        baseline=baseline,
    )  # fmt: skip
    assert literal.records == derived.records and literal.events == derived.events
    assert [e.action for e in literal.events] == ["rollback", "rollback"]
    by_step = {r.step: r.val_loss for r in baseline.records}
    assert all(r.val_loss == by_step[r.step] for r in literal.records)  # bit for bit
    assert derived.derived and not literal.derived


def test_trainer_snapshot_restore_is_bit_exact() -> None:
    trainer = PipelineTrainer(SETUP, plus=True)
    trainer.train_step(0)
    snap = trainer.snapshot()
    trainer.train_step(1)
    first = trainer.states()
    trainer.restore(snap)
    trainer.train_step(1)
    for a, b in zip(first, trainer.states(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_timeline_accounting(baseline: RunResult) -> None:
    kills = ScheduledFailures(kills={3: (1,)})
    ckpt = run_convergence(
        SETUP, ConvergencePolicy.parse("checkpoint:2"), kills, TIMES, steps=6, eval_every=2,
        baseline=baseline,
    )  # fmt: skip
    # 8 attempts of 100 s, 3 checkpoints of 10 s, one reload of 50 s; step 2 is redone.
    assert ckpt.total_time_s == pytest.approx(8 * 100 + 3 * 10 + 50)
    (event,) = ckpt.events
    assert (event.step, event.lost_steps, event.action) == (3, 1, "rollback")
    assert [(r.step, r.time_s) for r in ckpt.records] == [
        (0, 0), (2, 210), (4, 670), (6, 880),
    ]  # fmt: skip
    redundant = run_convergence(
        SETUP, ConvergencePolicy.parse("redundant"), ScheduledFailures(kills={1: (2,)}), TIMES,
        steps=6, eval_every=2, baseline=baseline,
    )  # fmt: skip
    assert redundant.total_time_s == pytest.approx(6 * 150 + 7)
    assert [r.val_loss for r in redundant.records] == [r.val_loss for r in baseline.records]
    assert baseline.total_time_s == pytest.approx(600)


def test_checkfree_rebuilds_and_falls_back(baseline: RunResult) -> None:
    kills = ScheduledFailures(kills={1: (1,), 3: (0,), 5: (1, 2)})
    plain = run_convergence(
        SETUP, ConvergencePolicy.parse("checkfree:2"), kills, TIMES, steps=6, eval_every=2
    )
    assert [e.action for e in plain.events] == ["neighbor_average", "rollback", "rollback"]
    plus = run_convergence(
        SETUP, ConvergencePolicy.parse("checkfree+"), kills, TIMES, steps=6, eval_every=2
    )
    assert [e.action for e in plus.events] == ["neighbor_average", "edge_copy", "reinit"]
    # Three abandoned attempts, each costing a step and a recovery.
    assert plus.total_time_s == pytest.approx(9 * 100 + 3 * 5)
    assert all(e.lost_steps == 0 for e in plus.events)
    again = run_convergence(
        SETUP, ConvergencePolicy.parse("checkfree+"), kills, TIMES, steps=6, eval_every=2
    )
    assert again.records == plus.records  # deterministic for a seed


def test_runs_that_cannot_progress_stop_and_say_so(baseline: RunResult) -> None:
    every_attempt = ScheduledFailures(kills={a: (0,) for a in range(100)})
    result = run_convergence(
        SETUP, ConvergencePolicy.parse("checkpoint:5"), every_attempt, TIMES, steps=6, eval_every=2,
        baseline=baseline, max_attempts=20,
    )  # fmt: skip
    assert result.info["finished"] is False and result.attempts == 20
    assert result.time_to(baseline.final_loss()) is None


# ---- the ablation -----------------------------------------------------------------------------


def test_ablation_neighbour_average_beats_copying_a_neighbour() -> None:
    """The paper's ablation in miniature: rebuild each lost middle stage of a trained tiny
    model by each method; the gradient-weighted average loses less than copying one
    neighbour (the paper: 22.6 vs 29.2 perplexity).

    The paper's third rung -- random re-initialisation far worse than both -- does not
    reproduce at this scale: a re-initialised tiny stage is close to the identity (its
    residual projections start near zero) and costs about as little as the average (see
    the experiment report); so it is not asserted here.
    """
    setup = dataclasses.replace(SETUP, microbatch_size=4, eval_batches=4, warmup_steps=5)
    trainer = PipelineTrainer(setup)
    for step in range(60):
        trainer.train_step(step)
    snap = trainer.snapshot()
    before = trainer.evaluate()
    increase = {}
    for averaging in ("weighted", "uniform", "copy"):
        total = 0.0
        for stage in (1, 2):
            trainer.restore(snap)
            trainer.rebuild([stage], CheckFreeConfig(averaging=averaging), step=60, attempt=0)
            total += trainer.evaluate() - before
        increase[averaging] = total / 2
    assert increase["weighted"] < increase["copy"], increase
    assert increase["uniform"] < increase["copy"], increase


# ---- the experiment driver -----------------------------------------------------------------


def test_experiment_config_and_summary(baseline: RunResult) -> None:
    exp = ConvergenceExperiment.from_dict(
        {
            "steps": 6,
            "eval_every": 2,
            "rates": [0.1, 0.2],
            "strategies": ["checkpoint:2", "checkpoint:4", "redundant"],
            "model": {"preset": "tiny", "microbatches": 2, "max_bytes": 1_000_000},
            "time": {"step_s": 600.0},
            "variant": [
                {
                    "label": "cf+ uniform",
                    "strategy": "checkfree+",
                    "averaging": "uniform",
                    "rates": [0.0],
                }
            ],
        }
    )
    assert exp.target is None and exp.setup.microbatches == 2
    names = [(k.strategy.name, k.rate) for k in exp.runs()]
    assert ("cf+ uniform", 0.0) in names and ("checkpoint-4", 0.2) in names and len(names) == 7
    with pytest.raises(ValueError, match="unknown top-level key"):
        ConvergenceExperiment.from_dict({"steps": 5, "stpes": 5})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['dims'\] in \[model\]"):
        ConvergenceExperiment.from_dict({"steps": 5, "model": {"dims": 3}})
    # A key renamed so that every cost model spells it one way names its new name.
    with pytest.raises(ValueError, match="'checkpoint_save_s' is now 'checkpoint_write_s'"):
        ConvergenceExperiment.from_dict({"steps": 5, "time": {"checkpoint_save_s": 3.0}})
    with pytest.raises(ValueError, match=r"\[sensitivity\].*'checkpoint_reload_s' is now"):
        ConvergenceExperiment.from_dict({"steps": 5, "sensitivity": {"checkpoint_reload_s": [1]}})
    runs = [baseline] + [
        exp.run(k, baseline=baseline) for k in exp.runs() if k.strategy.exact and k.rate == 0.2
    ]
    target = auto_target(baseline, 0.5)
    rows = summarize(runs, {0: target})
    # The oracle: each run's own time to the target, read off its records, and the fastest
    # checkpoint interval picked here, not by summarize.
    hours = {r.strategy: time_to_target(r.records, target) for r in runs if r.rate == 0.2}
    assert None not in hours.values(), hours
    h = {name: t / 3600 for name, t in hours.items() if t is not None}
    ckpt = {name: t for name, t in h.items() if name.startswith("checkpoint-")}
    assert len(ckpt) == 2 and len(set(ckpt.values())) == 2, ckpt  # a choice to get wrong
    fastest = min(ckpt, key=lambda name: ckpt[name])
    at = {r["strategy"]: r for r in rows if r["rate"] == 0.2}
    assert set(at) == {*h, "checkpoint (best)"}, sorted(at)
    best = at["checkpoint (best)"]
    assert best["best_of"] == fastest, (best["best_of"], ckpt)
    assert best["time_to_target_h"] == pytest.approx(ckpt[fastest])
    for name, hours_to_target in h.items():
        assert at[name]["time_to_target_h"] == pytest.approx(hours_to_target), name
        ratio = ckpt[fastest] / hours_to_target
        assert at[name]["vs_best_checkpoint"] == pytest.approx(ratio), name
    assert at[max(ckpt, key=lambda name: ckpt[name])]["vs_best_checkpoint"] < 1


def test_experiment_script_end_to_end(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("experiment", ROOT / "scripts" / "experiment.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = tmp_path / "smoke.toml"
    config.write_text(
        'kind = "convergence"\nsteps = 4\neval_every = 2\nrates = [0.4]\n'
        'strategies = ["checkfree+", "checkpoint:2", "redundant"]\n'
        '[model]\npreset = "tiny"\nmicrobatches = 2\nmicrobatch_size = 2\n'
        "max_bytes = 1_000_000\neval_batches = 1\n[time]\nstep_s = 900.0\n"
    )
    out = tmp_path / "out"
    assert module.main([str(config), "--out", str(out), "--quiet"]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["strategy"] for r in rows} >= {"none", "checkfree+", "checkpoint (best)"}
    assert (out / "time_to_target.png").exists() and (out / "convergence_rate40.png").exists()
    mtime = (out / "runs" / "checkfreeplus-r0.4-s0.json").stat().st_mtime
    assert module.main([str(config), "--out", str(out), "--quiet"]) == 0  # resumes: nothing re-run
    assert (out / "runs" / "checkfreeplus-r0.4-s0.json").stat().st_mtime == mtime
    with pytest.raises(SystemExit):
        bad = tmp_path / "bad.toml"
        bad.write_text('kind = "nope"\n')
        module.main([str(bad), "--out", str(out)])
    assert math.isfinite(rows[0]["final_val_loss"])
