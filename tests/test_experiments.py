"""Experiment matrices end to end: a real failure-injection run on Ray, and the simulator."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _experiment():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import experiment
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return experiment


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(900)
def test_runtime_experiment_2_strategies_x_2_seeds(tmp_path: Path) -> None:
    out = tmp_path / "runtime"
    assert (
        _experiment().main(
            [str(ROOT / "configs" / "runtime-smoke.toml"), "--out", str(out), "--quiet"]
        )
        == 0
    )
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert sorted((r["strategy"], r["seed"]) for r in rows) == [
        ("cold_start", "0"), ("cold_start", "1"), ("warm_spare", "0"), ("warm_spare", "1")
    ]  # fmt: skip
    for r in rows:
        assert 0 < float(r["goodput"]) <= 1.0 and int(r["recoveries"]) == int(r["failures"])
    assert (out / "runtime_loss_vs_time.png").stat().st_size > 10_000
    assert (out / "runtime_goodput.png").stat().st_size > 10_000
    assert "| warm_spare |" in (out / "results.md").read_text()
    # resumable: a second invocation loads the results instead of training again
    before = {p: p.stat().st_mtime for p in (out / "runs").iterdir()}
    assert (
        _experiment().main(
            [str(ROOT / "configs" / "runtime-smoke.toml"), "--out", str(out), "--quiet"]
        )
        == 0
    )
    assert {p: p.stat().st_mtime for p in (out / "runs").iterdir()} == before


def test_simulator_experiment_writes_goodput_vs_size(tmp_path: Path) -> None:
    config = tmp_path / "sim.toml"
    config.write_text(
        'kind = "simulator"\ndays = 10\nseeds = 5\nstrategies = ["checkpoint_restart", "replica_copy"]\n'
        'layouts = ["pp=4,dp=8,tp=8", "pp=8,dp=32,tp=8"]\n'
    )
    assert _experiment().main([str(config), "--out", str(tmp_path / "sim"), "--quiet"]) == 0
    rows = list(csv.DictReader((tmp_path / "sim" / "results.csv").open()))
    assert {r["gpus"] for r in rows} == {"256", "2048"} and len(rows) == 4
    assert all(0 <= float(r["goodput"]) <= 1 for r in rows)
    assert (tmp_path / "sim" / "simulated_goodput.png").exists()


def test_bad_experiment_files_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('kind = "runtime"\nrates = [2.0]\n[policies.a]\nhot_spares = 1\n')
    with pytest.raises(SystemExit):
        _experiment().main([str(config), "--out", str(tmp_path / "x")])
