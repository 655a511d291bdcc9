"""The examples run as a user runs them: a subprocess on an embedded local Ray, a kill
injected, the recovery printed. Slow (a Ray start each): `scripts/test_slow.sh` runs them."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(example: str, *extra: str) -> str:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{example}.py"), "--steps", "24", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _lines(stdout: str, prefix: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", ["custom_transformer", "vision", "gpt2", "metrics_callback"])
def test_an_example_recovers_and_ends_as_the_run_without_a_failure(
    example: str, tmp_path: Path
) -> None:
    """The example with its injected kill recovers (a replica copy at step 12) and ends with
    the losses and the final state digest (every tensor, `FitResult.state_digest`) of the
    same example run without the kill."""
    if example == "gpt2" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs the optional extra: pip install -e '.[hf]'")
    extra = ("--csv", str(tmp_path / "metrics.csv")) if example == "metrics_callback" else ()
    killed, clean = _run(example, *extra), _run(example, "--no-kill", *extra)
    assert _lines(killed, "recovery:") and _lines(killed, "recovery:")[0].startswith(
        "recovery: step 12, replica_copy"
    ), killed
    assert not _lines(clean, "recovery:"), clean
    for prefix in ("loss:", "final state digest:"):
        assert _lines(killed, prefix) and _lines(killed, prefix) == _lines(clean, prefix), prefix


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_metrics_callback_example_sends_every_step_and_the_recovery(tmp_path: Path) -> None:
    """Without MLflow, its callback writes a CSV: a loss row per step, the recovery's seconds
    at the step it struck; with a run folder, TensorBoard files too."""
    if importlib.util.find_spec("mlflow") is not None:
        pytest.skip("MLflow is installed: the example sends its metrics there")
    out = _run(
        "metrics_callback", "--csv", str(tmp_path / "m.csv"), "--run-dir", str(tmp_path / "run")
    )
    assert _lines(out, "metrics: sent to"), out
    with (tmp_path / "m.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows if r["name"] == "loss"] == list(range(24))
    (recovery,) = [r for r in rows if r["name"] == "recovery_s"]
    assert int(recovery["step"]) == 12 and float(recovery["value"]) > 0
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*")) != []
