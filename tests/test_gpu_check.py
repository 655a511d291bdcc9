"""scripts/gpu_check.py: the mode it picks for the GPUs it finds, and on a machine without a
GPU it says so and exits 0 (CI has none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def test_one_to_three_gpus_run_in_mode_5_and_four_over_nccl() -> None:
    """A 2x2 job over NCCL needs four GPUs (one rank per device); with fewer the checks run
    with Gloo communication and CUDA compute (mode 5) instead of being skipped."""
    from gpu_check import choose_mode

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
