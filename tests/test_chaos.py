"""scripts/chaos.py and recovery/faults/monkey.py: the kill schedule (pure, seeded), the SIGKILL
that says whether it landed, the chaos thread against a stand-in job, the oracle
(recovery/reference.py), and a short run of the script itself (real Ray, real kills, exit
status 0)."""

from __future__ import annotations

import itertools
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recovery.faults import ChaosMonkey, PlannedKill, kill_process, kill_schedule
from recovery.reference import differences
from recovery.worker import WorkerInfo

ROOT = Path(__file__).resolve().parents[1]


def test_the_kill_schedule_is_seeded_poisson_with_bursts() -> None:
    take = lambda seed, n=4000, **kw: list(  # noqa: E731
        itertools.islice(kill_schedule(seed=seed, mean_interval_s=2.0, burst_prob=0.25, **kw), n)
    )
    kills = take(7)
    assert kills == take(7)  # reproducible
    assert kills != take(8)
    times = [k.at_s for k in kills]
    assert times == sorted(times) and times[0] > 0
    assert all(0.0 <= k.pick < 1.0 for k in kills)
    assert not kills[0].burst and not any(a.burst and b.burst for a, b in itertools.pairwise(kills))
    bursts = [b.at_s - a.at_s for a, b in itertools.pairwise(kills) if b.burst]
    poisson = [b.at_s - a.at_s for a, b in itertools.pairwise(kills) if not b.burst]
    assert all(0.05 <= gap <= 0.5 for gap in bursts)
    assert 0.22 < len(bursts) / (len(kills) - len(bursts)) < 0.28  # a burst after 25% of kills
    assert 1.9 < statistics.mean(poisson) < 2.1  # exponential gaps, mean 2 s ...
    assert 1.8 < statistics.stdev(poisson) < 2.2  # ... and standard deviation = mean
    narrow = take(7, n=200, burst_gap_s=(0.2, 0.3))
    assert all(0.2 <= b.at_s - a.at_s <= 0.3 for a, b in itertools.pairwise(narrow) if b.burst)
    assert not any(k.burst for k in itertools.islice(kill_schedule(seed=1, mean_interval_s=1), 500))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mean_interval_s": 0},
        {"mean_interval_s": float("inf")},
        {"mean_interval_s": 1, "burst_prob": 1.5},
        {"mean_interval_s": 1, "burst_gap_s": (0.5, 0.1)},
        {"mean_interval_s": 1, "burst_gap_s": (-0.1, 0.1)},
    ],
)
def test_a_bad_schedule_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        next(kill_schedule(seed=0, **kwargs))  # type: ignore[arg-type]


def test_the_victim_is_picked_by_position() -> None:
    candidates = [(0, 0), (0, 1), (1, 0)]
    assert [PlannedKill(0, p, False).victim(candidates) for p in (0.0, 0.34, 0.99)] == candidates


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def test_a_kill_lands_only_on_a_live_process() -> None:
    proc = _sleeper()
    assert kill_process(proc.pid)
    time.sleep(0.2)
    assert not kill_process(proc.pid)  # dead and not reaped: a zombie
    proc.wait(5)
    assert not kill_process(proc.pid)  # gone


class _Job:
    """Stands in for a training `Trainer`: two workers (live processes) until ``ends``."""

    def __init__(self, ends: float) -> None:
        self.procs = {(0, 0): _sleeper(), (0, 1): _sleeper()}
        self.ends = ends

    def live_workers(self) -> dict[tuple[int, int], WorkerInfo]:
        if time.monotonic() > self.ends:
            return {}
        return {
            c: WorkerInfo(pid=p.pid, node_id="n", host="127.0.0.1") for c, p in self.procs.items()
        }


def test_the_monkey_kills_each_process_once_and_stops_with_the_job() -> None:
    schedule = [PlannedKill(t, 0.0, False) for t in (0.05, 0.1, 0.15, 2.0)]
    job = _Job(ends=time.monotonic() + 1.0)
    monkey = ChaosMonkey(job, schedule)
    try:
        monkey.start()
        assert monkey._thread is not None
        monkey._thread.join(5)
        assert not monkey._thread.is_alive()  # the job ended before the kill at 2 s
        got = [(r.worker, r.landed) for r in monkey.records]
        # (0,0) first; then (0,1), the only one not yet killed; then nobody is left
        assert got == [((0, 0), True), ((0, 1), True), (None, False)], monkey.records
        assert monkey.landed == 2
    finally:
        for p in job.procs.values():
            p.kill()
            p.wait(5)


def test_the_monkey_stops_after_max_kills() -> None:
    job = _Job(ends=time.monotonic() + 5.0)
    monkey = ChaosMonkey(job, [PlannedKill(t, 0.0, False) for t in (0.05, 0.1)], max_kills=1)
    try:
        monkey.start()
        assert monkey._thread is not None
        monkey._thread.join(5)
        assert [r.worker for r in monkey.records] == [(0, 0)]
        assert job.procs[(0, 1)].poll() is None  # alive
    finally:
        for p in job.procs.values():
            p.kill()
            p.wait(5)


def test_the_oracle_sees_one_flipped_bit() -> None:
    state = {(0, 0): {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"step": 4}}}}}
    same = {(0, 0): {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"step": 4}}}}}
    assert differences(same, state) == []
    flipped = torch.ones(3)
    flipped.view(torch.int32)[1] ^= 1
    same[(0, 0)]["model"]["w"] = flipped  # type: ignore[index]
    assert differences(same, state) == ["/(0, 0)/model/w: tensors differ"]
    assert differences([1.0, 2.0], [1.0, 2.0]) == []
    assert differences([1.0, 2.0], [1.0]) == [": 2 items vs 1"]
    assert differences([1.0, 2.0 + 1e-12], [1.0, 2.0]) != []


def test_the_tolerance_of_a_shrunk_job_is_relative_and_for_floats_only() -> None:
    """A job of 3+ replicas that shrank is held within a relative tolerance (elastic.py):
    floats within it pass, beyond it fail; integers (a step count) stay exact."""
    state = {"w": torch.tensor([1.0, -2.0]), "step": torch.tensor([4])}
    near = {"w": torch.tensor([1.0 + 1e-7, -2.0]), "step": torch.tensor([4])}
    far = {"w": torch.tensor([1.0 + 1e-3, -2.0]), "step": torch.tensor([4])}
    assert differences(near, state) == ["/w: tensors differ"]
    assert differences(near, state, rtol=1e-6) == []
    assert differences(far, state, rtol=1e-6) == ["/w: tensors differ by more than rtol 1e-06"]
    assert differences({**near, "step": torch.tensor([5])}, state, rtol=1e-6) != []
    assert differences([1.0 + 1e-7], [1.0], rtol=1e-6) == []
    assert differences([1.1], [1.0], rtol=1e-6) != []


def _chaos(*args: str, timeout_s: float) -> tuple[int, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "chaos.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _figures(out: str) -> dict[str, int]:
    found = {
        "landed": r"kills: \d+ attempted, (\d+) landed",
        "bursts": r"landed \((\d+) of them bursts\)",
        "survived": r"jobs: (\d+) survived",
        "died": r"survived, (\d+) died",
        "exact": r"oracle: (\d+) of \d+ jobs bit-identical",
        "jobs": r"oracle: \d+ of (\d+) jobs",
    }
    figures = {}
    for name, pattern in found.items():
        match = re.search(pattern, out)
        assert match, (name, out)
        figures[name] = int(match.group(1))
    return figures


@pytest.mark.slow  # (the default run has tests/test_outside_kills.py's kills from outside)
@pytest.mark.ray
@pytest.mark.timeout(400)
def test_a_short_chaos_run_survives_every_kill_bit_identical() -> None:
    """Four kills, half of them followed by a burst kill, on a 2x3 job with two hot spares:
    every job survives and ends bit-identical to the uninterrupted run; exit status 0."""
    rc, out = _chaos(
        "--kills", "4", "--mean-interval", "2", "--burst-prob", "0.5", "--seed", "3",
        "--steps", "200", "--hot-spares", "2", timeout_s=360,
    )  # fmt: skip
    figures = _figures(out)
    assert rc == 0, out
    assert figures["landed"] >= 4 and figures["died"] == 0, out
    assert figures["exact"] == figures["jobs"] == figures["survived"] >= 1, out
    assert re.search(r"recoveries: [1-9]\d* \(replica_copy", out), out


def test_a_bad_option_is_refused() -> None:
    rc, out = _chaos("--burst-prob", "2", timeout_s=60)
    assert rc == 2 and "--burst-prob must be in [0, 1]" in out


SOAK = [
    "--kills", "100", "--mean-interval", "3", "--burst-prob", "0.3", "--seed", "0", "--steps", "600",
    "--durable-every", "5", "--hot-spares", "2",
]  # fmt: skip
"""The soak of issue 12 (the command in docs/benchmarks.md): at least 100 kills with bursts."""


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(4000)
def test_the_soak_survives_a_hundred_kills_with_bursts_bit_identical() -> None:
    rc, out = _chaos(*SOAK, timeout_s=3900)
    figures = _figures(out)
    assert rc == 0, out[-5000:]
    assert figures["landed"] >= 100 and figures["bursts"] > 0 and figures["died"] == 0, out
    assert figures["exact"] == figures["jobs"], out
    assert re.search(r"[1-9]\d* interrupted by a further failure", out), out[-3000:]


SOAK_ELASTIC = [
    "--elastic", "--kills", "100", "--mean-interval", "3", "--burst-prob", "0.3", "--seed", "0",
    "--steps", "600", "--durable-every", "5", "--hot-spares", "1",
]  # fmt: skip
"""The elastic soak (the command in docs/benchmarks.md): kills the one spare cannot cover shrink the job."""


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(4000)
def test_the_elastic_soak_survives_a_hundred_kills_shrinking_and_growing() -> None:
    rc, out = _chaos(*SOAK_ELASTIC, timeout_s=3900)
    figures = _figures(out)
    assert rc == 0, out[-5000:]
    assert figures["landed"] >= 100 and figures["bursts"] > 0 and figures["died"] == 0, out
    within = re.search(r", (\d+) that shrank within", out)
    assert figures["exact"] + (int(within.group(1)) if within else 0) == figures["jobs"], out
    assert re.search(r"recoveries: .*shrink \d+", out) and re.search(r"grow", out), out[-3000:]


SOAK_NO_SPARES = [
    "--kills", "100", "--mean-interval", "3", "--burst-prob", "0.5", "--seed", "0", "--steps", "300",
    "--hot-spares", "0", "--durable-every", "0", "--keep-a-replica",
]  # fmt: skip
"""Issue 31's soak (the command in docs/benchmarks.md): no spare and no durable tier, half the kills in
bursts, every replacement cold; the monkey never takes a stage's last live replica, so every
job must survive -- a live worker is never thrown away -- and end bit-identical."""


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(4000)
@pytest.mark.parametrize("model", ["mlp", "bn-cnn"])
def test_the_soak_without_spares_or_a_durable_tier_loses_no_job(model: str) -> None:
    rc, out = _chaos(*SOAK_NO_SPARES, "--model", model, timeout_s=3900)
    figures = _figures(out)
    assert rc == 0, out[-5000:]
    assert figures["landed"] >= 100 and figures["bursts"] > 0 and figures["died"] == 0, out
    assert "0 lost after some stage had no live replica left" in out, out[-3000:]
    assert figures["exact"] == figures["jobs"] == figures["survived"], out
    assert re.search(r"[1-9]\d* interrupted by a further failure", out), out[-3000:]
