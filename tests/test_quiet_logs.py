"""User-facing noise: an expected kill prints one line of ours, not Ray's paragraph about an
unexpected death (which stays for deaths the job did not choose); a loopback-only Ray
started here does not warn about token authentication."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recovery.faults.exits import expect_exit
from recovery.groups import ray_env

ROOT = Path(__file__).resolve().parents[1]
RAY_DEATH = (
    "A worker died or was killed while executing a task by an unexpected system error. "
    "Worker IP address: 127.0.0.1 Worker port: 1 Worker PID: {pid} Worker exit type: "
    "SYSTEM_ERROR"
)


def test_rays_death_paragraph_is_left_out_only_for_expected_deaths(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ray._private import worker

    ray_env._quiet_expected_deaths()
    ray_env._quiet_expected_deaths()  # installed once
    expect_exit(4242, "injected kill at step 3")
    for pid in (4242, 4343):
        worker.print_to_stdstream(
            {"lines": [RAY_DEATH.format(pid=pid)], "pid": "raylet", "is_err": False},
            ignore_prefix=False,
        )
    out = capsys.readouterr().out
    assert "Worker PID: 4343" in out and "Worker PID: 4242" not in out


@pytest.mark.ray
@pytest.mark.own_ray  # the subprocess starts a Ray of its own
@pytest.mark.timeout(240)
def test_a_run_with_an_injected_kill_prints_no_ray_paragraph_and_no_auth_warning(
    tmp_path: Path,
) -> None:
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from ray import cloudpickle\n"
        "import tests.workloads\n"
        "cloudpickle.register_pickle_by_value(tests.workloads)\n"
        "from tests.workloads import mlp_spec\n"
        "from parallelism import Topology\n"
        "from recovery import FailureSchedule, Kill, Trainer\n"
        "r = Trainer(mlp_spec(), topology=Topology(2, 2),\n"
        "            failures=FailureSchedule([Kill(step=3, stage=1, replica=0)])).fit(6)\n"
        "print('events', len(r.events))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**env, "HOME": str(tmp_path)},  # no stale ~/.ray/auth_token either
        cwd=tmp_path,
        timeout=200,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "events 1" in text
    assert "step 3 failed (killed): lost (1,0)" in text  # our one line
    assert "A worker died or was killed" not in text
    assert "Token authentication is enabled" not in text
