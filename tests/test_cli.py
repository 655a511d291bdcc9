"""The main job from the command line: embedded local Ray, and a real `ray job submit`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--stages", "2", "--replicas", "2", "--layers", "2", "--dim", "32", "--seq-len", "32",
        "--steps", "6", "--eval-every", "3", "--no-progress"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train_script():  # type: ignore[no-untyped-def]
    """The program behind scripts/train.py (and `checkfree-train`), to call its main() on the
    embedded Ray."""
    import recovery.cli.train

    return recovery.cli.train


def test_train_script_help_runs_from_the_checkout() -> None:
    """`python scripts/train.py --help`, as the README says: the wrapper finds the installed
    package without editing sys.path, and the help lists the knobs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "scripts/train.py", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--stages" in done.stdout and "--failures" in done.stdout


def test_a_refused_setting_is_one_error_line_and_status_2(tmp_path: Path) -> None:
    """A setting checkfree refuses (here a global batch 2 replicas cannot share) ends the
    command as a bad flag does: ``checkfree train: error: ...`` and status 2, no traceback,
    before any worker starts -- from the script and from the ``checkfree`` dispatcher;
    ``CHECKFREE_TRACEBACK=1`` shows the traceback."""
    from simulations.cli import commands

    argv = ["--replicas", "2", "--global-batch", "7", "--steps", "2", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "scripts/train.py", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        "\ncheckfree train: error: a global batch of 7 samples does not divide among 2 replicas"
        in done.stderr
    )
    assert "Traceback" not in done.stderr
    loud = subprocess.run([sys.executable, "scripts/train.py", *argv], cwd=ROOT,
                          env={**os.environ, "CHECKFREE_TRACEBACK": "1"},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert loud.returncode == 1 and "Traceback" in loud.stderr and "ValueError" in loud.stderr
    assert commands.main(["train", *argv]) == 2


def test_no_failure_is_injected_unless_asked_for() -> None:
    """Re-running a command to resume it must not kill workers on purpose: ``auto`` (the
    demo's two kills) is asked for, not the default."""
    from parallelism import Topology

    train = _train_script()
    assert train.parse_args([]).failures == "none"
    assert len(train._failures("none", Topology(4, 2), 300)) == 0
    assert len(train._failures("auto", Topology(4, 2), 300)) == 2


class _Stop(Exception):
    """Raised by a fake Trainer's fit: the test has what it wanted."""


@pytest.mark.parametrize(
    ("argv", "name", "shape"),
    [
        (["--preset", "tiny"], "llama-tiny", {"dim": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 32}),
        ([], "llama-demo", {"dim": 128, "n_layers": 8, "n_heads": 4, "max_seq_len": 128}),
        (["--preset", "tiny", "--dim", "64", "--seq-len", "64"], "llama-tiny",
         {"dim": 64, "n_layers": 4, "n_heads": 4, "max_seq_len": 64}),
    ],
    ids=["tiny", "default", "tiny with overrides"],
)  # fmt: skip
def test_the_model_printed_is_the_model_trained(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    name: str,
    shape: dict[str, int],
) -> None:
    train = _train_script()
    specs = []

    class Recording:
        def __init__(self, spec: object, **kwargs: object) -> None:
            specs.append(spec)

        def fit(self, steps: int) -> None:
            raise _Stop

    monkeypatch.setattr(train, "Trainer", Recording)
    with pytest.raises(_Stop):
        train.main([*argv, "--no-progress", "--out", str(tmp_path / "run")])
    (spec,) = specs
    config = spec.build_stage.args[0]  # functools.partial(build_llama_stage, config)
    assert {k: getattr(config, k) for k in shape} == shape
    printed = capsys.readouterr().out
    assert spec.name == name and f"checkfree: {name} " in printed
    overridden = {k: v for k, v in shape.items() if f"'{k}': {v}" in printed}
    assert ("--dim" in argv) == bool(overridden)  # what the preset does not say is printed


def _check_run(out: Path) -> None:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6
    assert (out / "loss.png").exists()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_train_script_on_embedded_local_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo run (``--failures auto``) kills two workers and recovers both exactly."""
    import torch

    from parallelism.spec import TrainSpec
    from recovery.reference import train_reference
    from tests.test_engine import LOSS_RTOL

    train = _train_script()
    specs: list[TrainSpec] = []

    class Recording(train.Trainer):  # type: ignore[misc, name-defined]
        def __init__(self, spec: TrainSpec, **kwargs: object) -> None:
            specs.append(spec)
            super().__init__(spec, **kwargs)

    monkeypatch.setattr(train, "Trainer", Recording)
    assert train.main([*TINY, "--failures", "auto", "--out", str(tmp_path / "run")]) == 0
    assert "validation loss" in capsys.readouterr().out
    _check_run(tmp_path / "run")
    # The kills that --help promises for 6 steps of 2 x 2 workers: stage 1 (the last one)
    # of replica 0 a third of the way in, of replica 1 two thirds in. Each must have fired
    # and been recovered from the other replica, losing no step.
    log = tmp_path / "run" / "events.jsonl"  # written at the first recovery
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert [(e["step"], e["cause"], e["lost"]) for e in events] == [
        (2, "killed", [[1, 0]]),
        (4, "killed", [[1, 1]]),
    ], events
    for event, source in zip(events, ([1, 1], [1, 0]), strict=True):
        assert event["strategy"] == "replica_copy" and event["lost_steps"] == 0, event
        assert [a["sources"] for a in event["actions"]] == [[source]], event
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["recoveries"], summary["lost_steps"]) == (2, 0)
    # Exact recovery: the losses are those of the same model trained in one process with
    # no failure (recovery.reference), step for step.
    (spec,) = specs
    metrics = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == list(range(6))
    ref = train_reference(spec, stages=2, replicas=2, steps=6)
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in metrics], dtype=torch.float64),
        torch.tensor(ref.losses, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_train_script_dlrm_recovers_a_shard_partially(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = _train_script()
    args = ["--model", "dlrm", "--preset", "tiny", "--batch-size", "16", "--steps", "9",
            "--failures", "kill:step=7,stage=0,replica=2", "--mirror-every", "5",
            "--mirror-hot-rows", "2", "--pls-budget", "1", "--eval-every", "3",
            "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert "embedding_partial" in out and "stale" in out and "shard mirrors per worker" in out
    event = json.loads((tmp_path / "run" / "events.jsonl").read_text().splitlines()[0])
    assert event["embedding"]["rows_stale"] > 0 and event["lost_steps"] == 0


@pytest.mark.ray
@pytest.mark.own_ray
@pytest.mark.timeout(600)
def test_ray_job_submit_of_the_train_script(tmp_path: Path) -> None:
    """`ray start --head` on 127.0.0.1, `ray job submit` of scripts/train.py, the head stopped.

    The head runs with ``--block`` and is stopped by a signal, which stops what it started
    and nothing else: `ray stop` would end every Ray on the machine, the session's of the
    test process beside this one included."""
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    # Auth off so a stale ~/.ray/auth_token cannot matter; cluster mode off keeps Ray on loopback.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    gcs, dash, agent = _free_port(), _free_port(), _free_port()
    start = [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--dashboard-host", "127.0.0.1", "--port", str(gcs), "--dashboard-port", str(dash),
             "--dashboard-agent-listen-port", str(agent), "--disable-usage-stats"]  # fmt: skip
    log = tmp_path / "head.log"
    with log.open("wb") as sink:
        head = subprocess.Popen(start, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_for_dashboard(dash, head, log)
        out = tmp_path / "job"
        submit = [ray_bin, "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir",
                  str(ROOT), "--", "python", "scripts/train.py", *TINY, "--out", str(out)]  # fmt: skip
        job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=480, cwd=ROOT)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout + job.stderr
        _check_run(out)
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=60)


def _wait_for_dashboard(
    port: int, head: subprocess.Popen[bytes], log: Path, within_s: float = 120
) -> None:
    """Wait until the head's dashboard answers (jobs are submitted through it)."""
    import urllib.request

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise AssertionError(
                f"`ray start --head` exited with {head.returncode}: {log.read_text()[-3000:]}"
            )
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"the dashboard on port {port} did not answer within {within_s:g} s")
