"""Stragglers on Ray, made from outside the library: a worker process stopped and continued
in a duty cycle (SIGSTOP/SIGCONT, `recovery.faults.Throttle`, run by this process) is found
slower than its replica, replaced by a warm spare from that replica, and the job ends bit
for bit where the run that was never slowed ends. A healthy job beside a CPU hog replaces
nobody. The detector itself, the policy and the library's `Slow` fault: test_stragglers.py.

The test machine has two cores shared by eight workers, a spare, the driver and whatever
else runs there: a 3x duty cycle shows there as 1.7-3x compute, with healthy replicas'
per-step times differing by 2x now and then (measured while a whole test suite ran
beside). So the outside-throttle jobs find stragglers at factor 1.5 (the default, 2, is
for machines whose replicas compute alike; tests/test_stragglers.py holds it to its
rule), and the step-time figure -- back to at most 1.2x the unslowed step -- is a slow test
(scripts/test_slow.sh) and a printed measurement (``checkfree bench stragglers``).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest

from parallelism import Topology
from recovery import RecoveryPolicy, StragglerPolicy, Trainer
from recovery.cli.chaos import throttled_fit
from recovery.cli.workloads import spec
from recovery.names import FailureCause, Strategy
from recovery.reference import differences
from recovery.runtime.steps import BATCH_STEPS

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

TOP = Topology(4, 2)
STEPS = 70
ONSET = 20
SLOWED = (1, 0)
SPEC = spec(0, "wide-mlp")
PLAIN = RecoveryPolicy(hot_spares=1, snapshots={"peer_every": None})
POLICY = RecoveryPolicy(
    hot_spares=1, snapshots={"peer_every": None}, stragglers=StragglerPolicy(factor=1.5)
)


@pytest.fixture(scope="module")
def oracle():  # type: ignore[no-untyped-def]
    return Trainer(SPEC, topology=TOP, policy=PLAIN).fit(STEPS)


def _check_replaced(result, throttle, onset: int, policy: RecoveryPolicy) -> None:  # type: ignore[no-untyped-def]
    (event,) = result.events
    assert event.cause == FailureCause.STRAGGLER, event
    assert event.lost == [SLOWED] and event.strategy == Strategy.REPLICA_COPY, event
    assert event.lost_steps == 0 and event.actions[0]["warm"], event
    (record,) = event.stragglers
    assert record["worker"] == SLOWED and record["ratio"] > 1.0, record
    assert policy.stragglers is not None
    # Found within two windows (one, where the machine is quiet: a whole suite running
    # beside made a healthy replica's window miss the quorum once, found at step 63 for
    # onset 20); replaced at the next boundary (at most a batch later). The one-window
    # bound is held exactly in test_stragglers.py, where the slowdown is the library's.
    assert onset <= event.step <= onset + 2 * policy.stragglers.patience + BATCH_STEPS, (
        onset,
        event.step,
    )


def test_a_worker_throttled_from_outside_is_replaced_bit_identical(oracle) -> None:  # type: ignore[no-untyped-def]
    result, throttle, onset, _ = throttled_fit(
        SPEC, TOP, POLICY, STEPS, worker=SLOWED, at_step=ONSET, factor=3.0
    )
    _check_replaced(result, throttle, onset, POLICY)
    assert throttle.exited, "the throttled worker's process never exited"
    assert not differences(result.losses, oracle.losses, where="losses")
    assert not differences(result.states, oracle.states, where="states")


def _median_step(metrics: list[dict], first: int, last: int) -> float:  # type: ignore[type-arg]
    return statistics.median(m["step_s"] for m in metrics if first <= m["step"] < last)


@pytest.mark.slow
def test_after_the_replacement_the_step_is_back_within_1_2x() -> None:
    """Back-to-back: the job never slowed, then the same job with (1,0) throttled 3x from
    step 20; after the replacement (and 10 s for the spare it took to be started again
    beside it: a new process importing torch, ~5 s of CPU here) its median step is within
    1.2x of the unslowed job's over the same steps."""
    steps = 350
    plain = Trainer(SPEC, topology=TOP, policy=POLICY).fit(steps)
    result, throttle, onset, _ = throttled_fit(
        SPEC, TOP, POLICY, steps, worker=SLOWED, at_step=ONSET, factor=3.0
    )
    _check_replaced(result, throttle, onset, POLICY)
    (event,) = result.events
    settled = min(m["step"] for m in result.metrics if m["time"] >= event.time + 10.0)
    after = (settled, steps)
    before = _median_step(plain.metrics, *after)
    again = _median_step(result.metrics, *after)
    during = _median_step(result.metrics, onset, event.step)
    print(f"step: unslowed {before:.3f} s, throttled {during:.3f} s, after {again:.3f} s")
    assert again <= 1.2 * before, (before, during, again)


@pytest.mark.slow
def test_a_healthy_job_beside_a_cpu_hog_replaces_nobody_in_1000_steps() -> None:
    """A process spinning on a core beside the job slows every worker in turn, none
    persistently: with the default rule, no straggler in 1,000 steps -- and none even
    without the minimum gap, on the tiny MLP whose stages compute for ~0.1 ms."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        for config in (StragglerPolicy(), StragglerPolicy(min_gap_s=0.0)):
            policy = RecoveryPolicy(hot_spares=1, stragglers=config)
            model = "wide-mlp" if config.min_gap_s else "mlp"
            steps = 300 if config.min_gap_s else 1000
            result = Trainer(spec(0, model), topology=TOP, policy=policy).fit(steps)
            assert not result.events, (model, [e.detail for e in result.events])
    finally:
        hog.kill()
        hog.wait(10)
