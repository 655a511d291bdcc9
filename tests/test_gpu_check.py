"""`checkfree gpu-check` (recovery/cli/gpu_check.py; scripts/gpu_check.py runs it): the mode
it picks for the GPUs it finds, on a machine without a GPU it says so and exits 0 (CI has
none), its time budget, and what its checks run on."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_one_to_three_gpus_run_in_mode_5_and_four_over_nccl() -> None:
    """A 2x2 job over NCCL needs four GPUs (one rank per device); with fewer the checks run
    with Gloo communication and CUDA compute (mode 5) instead of being skipped."""
    from recovery.cli.gpu_check import choose_mode

    assert choose_mode(0) is None
    assert [choose_mode(n) for n in (1, 2, 3)] == [("gloo", "cuda")] * 3
    assert choose_mode(4) == ("nccl", "cuda") == choose_mode(8)
    assert choose_mode(0, cpu=True) == ("gloo", "cpu") == choose_mode(4, cpu=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no GPU found" in done.stdout


@pytest.mark.slow
def test_the_checks_pass_on_the_cpu() -> None:
    """``--cpu`` runs the same checks over Gloo: the script's logic, without a GPU (~45 s)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--bench-preset", "none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("| pass ") == 4, done.stdout


def test_checks_that_would_start_after_the_deadline_are_not_run() -> None:
    """The issue's time budget: once the deadline has passed, the remaining checks are
    listed as not run and never called; a check that raises is a failure, not the end."""
    from recovery.cli.gpu_check import NOT_RUN, run_checks

    now = [0.0]
    called: list[str] = []

    def check(
        name: str, seconds: float, ok: bool = True
    ) -> tuple[str, Callable[[], tuple[bool, str]]]:
        def run() -> tuple[bool, str]:
            called.append(name)
            now[0] += seconds
            if name == "crashes":
                raise RuntimeError("boom")
            return ok, f"{name} done"

        return (name, run)

    checks = [check("a", 3), check("crashes", 4), check("b", 1, ok=False), check("late", 1)]
    rows = run_checks(checks, deadline=8.0, clock=lambda: now[0])
    assert called == ["a", "crashes", "b"]
    assert [result for _, result, _ in rows] == ["pass", "FAIL", "FAIL", NOT_RUN]
    assert rows[1][2] == "RuntimeError: boom"
    assert NOT_RUN == "not run (time budget)"


def test_the_single_process_run_is_on_the_jobs_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 2x2 job is compared with single-process training on the same device (CUDA in
    mode 5 and under NCCL), and the tolerance is printed."""
    from recovery.cli import gpu_check

    asked: dict[str, object] = {}

    def reference(spec: object, **kwargs: object) -> SimpleNamespace:
        asked.update(kwargs)
        return SimpleNamespace(losses=[1.0, 0.5])

    monkeypatch.setattr(gpu_check, "train_reference", reference)
    ok, detail = gpu_check.check_equivalence(("gloo", "cuda"), SimpleNamespace(losses=[1.0, 0.5]))
    assert ok and asked["device"] == "cuda"
    assert f"tolerance {gpu_check.LOSS_RTOL:g}" in detail and "on cuda" in detail
    ok, _ = gpu_check.check_equivalence(("gloo", "cpu"), SimpleNamespace(losses=[1.0, 0.6]))
    assert not ok and asked["device"] == "cpu"


def test_the_bench_runs_about_100_MB_on_the_device_within_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench.py recovery runs the ~100 MB preset in the job's mode, and is cut off at the
    deadline (a timeout is a failed check, not a crash)."""
    from parallelism.workloads.llama import LlamaConfig
    from recovery.cli import gpu_check

    megabytes = LlamaConfig.preset(gpu_check.BENCH_PRESET).num_parameters() * 4 / 1e6
    assert 90 <= megabytes <= 110, megabytes

    ran: list[tuple[list[str], float]] = []

    def fake_run(cmd: list[str], *, timeout: float, **_: object) -> SimpleNamespace:
        ran.append((cmd, timeout))
        if len(ran) == 2:
            raise subprocess.TimeoutExpired(cmd, timeout)
        return SimpleNamespace(returncode=0, stdout="small: 25.6M parameters\n", stderr="")

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    deadline = gpu_check.time.monotonic() + 30
    assert gpu_check.check_bench(("gloo", "cuda"), gpu_check.BENCH_PRESET, deadline)[0]
    cmd, timeout = ran[0]
    assert " ".join(cmd).endswith(
        "--presets small --stages 2 --replicas 2 --backend gloo --device cuda"
    )
    assert 0 < timeout <= 30
    ok, detail = gpu_check.check_bench(("gloo", "cuda"), gpu_check.BENCH_PRESET, deadline)
    assert not ok and "time budget" in detail


def test_without_a_checkout_the_bench_check_fails_saying_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Installed from a wheel there is no scripts/bench.py: the check fails, naming the way
    out, instead of running a missing file."""
    from recovery.cli import gpu_check

    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    ok, detail = gpu_check.check_bench(("gloo", "cpu"), "tiny", gpu_check.time.monotonic() + 30)
    assert not ok and "checkout" in detail and "--bench-preset none" in detail
