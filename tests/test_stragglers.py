"""Stragglers (recovery/runtime/stragglers.py): the detector as a pure class, the policy
knob, the `Slow` fault, and whole jobs over threads where a slowed worker is replaced from
its live replica, bit for bit. The Ray tests -- a worker throttled from outside by
SIGSTOP/SIGCONT -- are in tests/test_stragglers_ray.py."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism import Topology
from recovery import FailureSchedule, RecoveryPolicy, Slow, StragglerPolicy
from recovery.names import FailureCause, Strategy
from recovery.reference import differences
from recovery.runtime import Phase
from recovery.runtime.decisions import AtBoundary, at_boundary
from recovery.runtime.membership import SLOW_NODE_STRAGGLERS
from recovery.runtime.stragglers import StragglerDetector, medians_of_others
from tests.jobs import drive, make
from tests.workloads import mlp_spec

TOP = Topology(4, 2)
CONFIG = StragglerPolicy()  # the defaults: 2x over a window of 20, half of it slow


def _feed(
    detector: StragglerDetector,
    steps: range,
    compute: dict[int, float],
    *,
    noise: float = 0.0,
    rng: random.Random | None = None,
) -> list[int]:
    """Observe ``steps`` with each rank's compute (times 1 +- ``noise``); returns the steps
    after which anyone was found."""
    rng = rng or random.Random(0)
    hits = []
    for step in steps:
        detector.observe(
            step, {r: c * (1 + rng.uniform(-noise, noise)) for r, c in compute.items()}
        )
        if detector.found():
            hits.append(step)
    return hits


def _healthy(top: Topology, seconds: float = 0.010) -> dict[int, float]:
    return {r: seconds for r in range(top.world_size)}


# -- the detector, pure ---------------------------------------------------------------------


def test_a_3x_slow_worker_is_found_within_the_patience() -> None:
    detector = StragglerDetector(TOP, CONFIG)
    _feed(detector, range(0, 30), _healthy(TOP), noise=0.2)  # a healthy start: nobody
    assert not detector.found()
    slow = TOP.rank(1, 0)
    compute = _healthy(TOP) | {slow: 0.030}
    hits = _feed(detector, range(30, 60), compute, noise=0.2)
    assert hits and hits[0] - 30 < CONFIG.patience, hits
    (found,) = detector.found()
    assert found.rank == slow and 2.5 < found.ratio < 3.5, found
    assert "straggler" in found.describe()


def test_a_duty_cycled_worker_slow_in_most_steps_only_is_found() -> None:
    """Stopped and continued from outside, a worker's compute is slow in most steps, not
    all (some fall between two stops): 3 steps in 4 slow is found all the same."""
    detector = StragglerDetector(TOP, CONFIG)
    slow = TOP.rank(2, 1)
    for step in range(40):
        compute = _healthy(TOP) | ({slow: 0.040} if step % 4 else {})
        detector.observe(step, compute)
    assert [s.rank for s in detector.found()] == [slow]


def test_a_single_noisy_step_never_triggers_however_slow() -> None:
    detector = StragglerDetector(TOP, CONFIG)
    hits = []
    for step in range(200):
        compute = _healthy(TOP)
        if step % 25 == 7:  # one step in 25: one worker 100x slower
            compute[TOP.rank(step % 4, 0)] = 1.0
        detector.observe(step, compute)
        hits += [s.rank for s in detector.found()]
    assert not hits


def test_a_few_outliers_lift_the_sum_but_never_decide() -> None:
    """Nine steps in a window of 20 (one short of the quorum), each 100x slower: the
    window's sum is 45x the others', but nine steps in 20 are not a straggler."""
    detector = StragglerDetector(TOP, CONFIG)
    slow = TOP.rank(3, 1)
    for step in range(200):
        compute = _healthy(TOP)
        if step % 20 < 9:
            compute[slow] = 1.0
        detector.observe(step, compute)
        assert not detector.found(), step


def test_a_mildly_slower_worker_is_no_straggler() -> None:
    """1.5x in every step (a slower core, a busier neighbour): below the factor."""
    detector = StragglerDetector(TOP, CONFIG)
    assert not _feed(detector, range(200), _healthy(TOP) | {5: 0.015}, noise=0.1)


def test_no_trigger_when_every_replica_slows_together() -> None:
    """The whole machine slows down (a CPU hog, a throttled host): every replica of every
    stage computes 5x slower, with noise -- the ratio to the median stays near 1."""
    detector = StragglerDetector(TOP, CONFIG)
    assert not _feed(detector, range(0, 50), _healthy(TOP), noise=0.3)
    assert not _feed(detector, range(50, 300), _healthy(TOP, 0.050), noise=0.3)


def test_no_trigger_with_a_single_replica() -> None:
    """dp=1: nothing to compare with, so nobody is ever judged."""
    top = Topology(4, 1)
    detector = StragglerDetector(top, CONFIG)
    assert not detector.judges
    compute = _healthy(top) | {2: 1.0}
    assert not _feed(detector, range(100), compute)


def test_tiny_times_below_the_gap_are_noise() -> None:
    detector = StragglerDetector(TOP, CONFIG)
    compute = _healthy(TOP, 0.0001) | {0: 0.0005}  # 5x, but 0.4 ms apart
    assert not _feed(detector, range(100), compute)
    strict = StragglerDetector(TOP, StragglerPolicy(min_gap_s=0.0))
    assert _feed(strict, range(100), compute)


def test_never_every_replica_of_a_stage() -> None:
    """Three replicas, two of them slow: the fastest is never found (it cannot be 2x the
    others), and of the slow ones each is compared with the other two."""
    top = Topology(1, 3)
    detector = StragglerDetector(top, CONFIG)
    _feed(detector, range(40), {0: 0.010, 1: 0.050, 2: 0.052})
    assert len(detector.found()) < 3
    detector.reset()
    assert not detector.found()
    _feed(detector, range(40), {0: 0.010, 1: 0.010, 2: 0.050})
    assert [s.rank for s in detector.found()] == [2]


def test_the_first_window_is_not_judged_and_a_reset_starts_afresh() -> None:
    detector = StragglerDetector(TOP, CONFIG)
    compute = _healthy(TOP) | {3: 0.050}
    assert not _feed(detector, range(CONFIG.patience - 1), compute)
    assert _feed(detector, range(CONFIG.patience - 1, CONFIG.patience), compute)
    detector.reset([3])
    assert not detector.found()


def test_the_boundary_replaces_stragglers_but_finishes_first() -> None:
    assert at_boundary(3, 10, missing=False, spares_ready=False, stragglers=True) is (
        AtBoundary.STRAGGLER
    )
    assert at_boundary(10, 10, missing=False, spares_ready=False, stragglers=True) is (
        AtBoundary.FINISH
    )


# -- the policy and the fault ---------------------------------------------------------------


def test_the_policy_knob() -> None:
    assert RecoveryPolicy().stragglers is None
    assert RecoveryPolicy(stragglers=False).stragglers is None
    assert RecoveryPolicy(stragglers=True).stragglers == StragglerPolicy()
    assert RecoveryPolicy(stragglers={"factor": 3.0}).stragglers == StragglerPolicy(factor=3.0)
    for bad, name in [
        ({"factor": 1.0}, "factor"),
        ({"patience": 0}, "patience"),
        ({"quorum": 0.0}, "quorum"),
        ({"min_gap_s": -1}, "min_gap_s"),
    ]:
        with pytest.raises(ValueError, match=f"stragglers.{name}"):
            RecoveryPolicy(stragglers=bad)
    with pytest.raises(ValueError, match="unknown key"):
        RecoveryPolicy(stragglers={"factr": 3})


def test_the_slow_fault_in_text_form() -> None:
    schedule = FailureSchedule.parse(
        "slow:step=10,stage=1,replica=0,factor=3", topology=TOP, steps=20
    )
    (fault,) = schedule
    assert fault == Slow(step=10, stage=1, replica=0, factor=3.0)
    assert FailureSchedule.parse(str(schedule), topology=TOP, steps=20).faults == schedule.faults
    assert FailureSchedule.parse("slow:step=1,stage=0", topology=TOP, steps=5).faults[0].factor == 3
    with pytest.raises(ValueError, match="factor"):
        FailureSchedule.parse("slow:step=1,stage=0,factor=0.5", topology=TOP, steps=5)


# -- whole jobs over threads ----------------------------------------------------------------

STEPS = 60
SLOWED = (1, 0)
POLICY = RecoveryPolicy(
    hot_spares=1,
    snapshots={"peer_every": None},
    stragglers=StragglerPolicy(min_gap_s=0.0005),
)


@pytest.fixture(scope="module")
def oracle():  # type: ignore[no-untyped-def]
    controller, _ = make(mlp_spec(), TOP, steps=STEPS, policy=RecoveryPolicy(hot_spares=1))
    assert drive(controller)[-1] is Phase.FINISHED
    return controller


def test_a_slowed_worker_is_replaced_from_its_replica_bit_identical(oracle) -> None:  # type: ignore[no-untyped-def]
    onset = 10
    controller, _ = make(
        mlp_spec(),
        TOP,
        Slow(step=onset, stage=SLOWED[0], replica=SLOWED[1], factor=6.0),
        steps=STEPS,
        policy=POLICY,
    )
    assert drive(controller)[-1] is Phase.FINISHED
    (event,) = controller.events
    assert event.cause == FailureCause.STRAGGLER
    assert event.lost == [SLOWED] and event.strategy == Strategy.REPLICA_COPY
    assert event.lost_steps == 0
    (record,) = event.stragglers
    assert record["worker"] == SLOWED and record["ratio"] > POLICY.stragglers.factor, record
    assert event.step - onset <= POLICY.stragglers.patience + 16, event.step  # one batch late
    losses = [r.loss for r in controller.records]
    assert not differences(losses, [r.loss for r in oracle.records], where="losses")
    assert not differences(controller.final_states, oracle.final_states, where="states")


def test_an_elastic_job_without_a_spare_leaves_the_straggler_out_and_grows_back(oracle) -> None:  # type: ignore[no-untyped-def]
    """No spare: an elastic job shrinks without the straggler at once (no cold start to
    wait for) and grows back when its replacement is ready -- two replicas, so every step
    stays the failure-free step, bit for bit."""
    policy = RecoveryPolicy(
        hot_spares=0,
        elastic=True,
        snapshots={"peer_every": None},
        stragglers=StragglerPolicy(min_gap_s=0.0005),
    )
    controller, _ = make(
        mlp_spec(), TOP, Slow(step=5, stage=2, replica=1, factor=6.0), steps=STEPS, policy=policy
    )
    assert drive(controller)[-1] is Phase.FINISHED
    first, *rest = controller.events
    assert first.cause == FailureCause.STRAGGLER and first.lost == [(2, 1)], first
    assert first.strategy == Strategy.SHRINK, first
    assert [e.strategy for e in rest] == [Strategy.GROW], rest
    assert not differences(controller.final_states, oracle.final_states, where="states")


def test_off_changes_nothing_and_a_slowed_worker_stays(oracle) -> None:  # type: ignore[no-untyped-def]
    controller, _ = make(
        mlp_spec(),
        TOP,
        Slow(step=5, stage=SLOWED[0], replica=SLOWED[1], factor=6.0),
        steps=STEPS,
        policy=RecoveryPolicy(hot_spares=1),
    )
    assert drive(controller)[-1] is Phase.FINISHED
    assert not controller.events
    assert not differences(controller.final_states, oracle.final_states, where="states")


def test_a_node_that_keeps_producing_stragglers_is_avoided() -> None:
    controller, _ = make(mlp_spec(), TOP, steps=1, policy=POLICY, nodes=2)
    try:
        members = controller.members
        assert members is not None
        node = members.assignment[TOP.rank(0, 0)]
        members.note_stragglers([TOP.rank(0, 0)])
        assert node not in members.slow_nodes()
        members.note_stragglers([TOP.rank(1, 0)] * (SLOW_NODE_STRAGGLERS - 1))
        assert node in members.slow_nodes()
        assert node not in members.live_nodes()
        placed = members.replacements([TOP.rank(2, 0)])
        assert node not in placed.values(), placed
    finally:
        controller.shutdown()


@given(
    st.lists(st.sampled_from([0.0, 0.001, 0.5, 1.0, 1.0, 2.5, 1e-9, 3.0]), min_size=2, max_size=9)
)
def test_the_median_of_the_others_is_statistics_median_of_the_rest(values: list[float]) -> None:
    want = [statistics.median(values[:i] + values[i + 1 :]) for i in range(len(values))]
    assert medians_of_others(values) == want
