"""Failures during a recovery: the recovery plans again and the job ends exact.

[Note: re-entrant recovery] in recovery/runtime/controller.py. Each test kills one worker
with the library's `FailureSchedule` and a second one from outside (the thread group's
`chaos`, which the controller knows nothing about) while the first recovery is in one of
its phases: a replacement starting, a survivor joining the next generation, the source
or the target of a state transfer, a rollback loading. The oracle is the run that never
failed, bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from parallelism import Topology
from recovery import Kill, RecoveryError, RecoveryPolicy, SnapshotPolicy
from recovery.groups import ThreadWorkerGroup
from recovery.runtime import Controller, Phase
from recovery.runtime.controller import MAX_INTERRUPTIONS
from tests.jobs import drive, make
from tests.test_controller import assert_equal_states
from tests.workloads import mlp_spec

TOP = Topology(2, 3)
FIRST = Kill(step=2, stage=1, replica=0)


@pytest.fixture(scope="module")
def oracle() -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    controller, _ = make(mlp_spec(), TOP)
    drive(controller)
    return controller.final_states  # type: ignore[attr-defined,no-any-return]


def once(rank: int, method: str, delay: float = 0.0) -> Callable[[int, str], float | None]:
    """A chaos rule: kill ``rank`` ``delay`` s after its first ``method`` call starts."""
    fired = []

    def rule(r: int, m: str) -> float | None:
        if r == rank and m == method and not fired:
            fired.append(m)
            return delay
        return None

    return rule


def run(
    chaos: Callable[[int, str], float | None], policy: RecoveryPolicy | None = None
) -> tuple[Controller, ThreadWorkerGroup]:
    controller, group = make(mlp_spec(), TOP, FIRST, policy=policy, nodes=3)
    group.chaos = chaos
    drive(controller)
    return controller, group


LOST = TOP.rank(1, 0)
SURVIVOR = TOP.rank(0, 1)  # a survivor of another stage
SOURCE = TOP.rank(1, 1)  # the planner's source for (1, 0): the lowest live replica


@pytest.mark.parametrize(
    ("victim", "method", "phase"),
    [
        (LOST, "setup", "replacing"),  # the replacement dies while it is built
        (SURVIVOR, "join", "reforming"),  # a survivor dies while the groups form
        (SOURCE, "send_state", "restoring"),  # the source of the transfer dies
        (LOST, "recv_state", "restoring"),  # the target dies while receiving
    ],
    ids=["replacement", "joining-survivor", "transfer-source", "transfer-target"],
)
def test_a_death_in_each_recovery_phase_is_recovered_exactly(
    oracle, victim: int, method: str, phase: str
) -> None:  # type: ignore[no-untyped-def]
    controller, _ = run(once(victim, method, delay=0.0))
    assert controller.phase is Phase.FINISHED, controller.error
    (event,) = controller.events
    assert [note.split(":")[0] for note in event.interruptions] == [phase]
    assert TOP.worker(victim) in {TOP.worker(TOP.rank(s, r)) for s, r in event.lost}
    assert event.strategy == "replica_copy"
    assert_equal_states(controller.final_states, oracle)  # type: ignore[attr-defined]


def test_the_source_dying_in_the_middle_of_sending_is_recovered_exactly(oracle) -> None:  # type: ignore[no-untyped-def]
    """Killed 1 ms into the send, from another thread: the target's receive breaks."""
    controller, _ = run(once(SOURCE, "send_state", delay=0.001))
    assert controller.phase is Phase.FINISHED, controller.error
    events = controller.events
    if len(events) == 2:  # the send finished first: the kill broke the next step instead
        assert events[0].interruptions == [] and events[1].lost == [(1, 1)], events
    else:
        (event,) = events
        assert event.interruptions and event.interruptions[0].startswith("restoring"), event
    assert_equal_states(controller.final_states, oracle)  # type: ignore[attr-defined]


def _second_deaths() -> list[tuple[int, str]]:
    """Every (victim, call) in which a second death can strike the recovery of (1,0): any
    other worker leaving the step (``prepare_recovery``) or joining the next generation,
    and the transfer's source sending. (Replacements are set up and receive: (1,0) only.)"""
    others = sorted(set(range(TOP.world_size)) - {LOST})
    pairs = [(v, m) for m in ("prepare_recovery", "join") for v in others]
    return [*pairs, (SOURCE, "send_state")]


@pytest.mark.parametrize(("victim", "method"), _second_deaths())
def test_any_second_death_during_the_recovery_ends_exact(oracle, victim: int, method: str) -> None:  # type: ignore[no-untyped-def]
    """Whoever dies, in whichever recovery call: as long as a replica of every stage is
    left, the job ends bit-identical to one that never failed -- and the death did strike
    the recovery: in its first phase (the victim is lost with (1,0)) or later (the recovery
    was interrupted and planned again)."""
    fired: list[int] = []
    rule = once(victim, method)

    def chaos(rank: int, called: str) -> float | None:
        delay = rule(rank, called)
        if delay is not None:
            fired.append(rank)
        return delay

    controller, _ = run(chaos)
    assert fired == [victim]
    assert controller.phase is Phase.FINISHED, controller.error
    (event,) = controller.events
    assert TOP.worker(victim) in {TOP.worker(TOP.rank(s, r)) for s, r in event.lost}
    if method == "prepare_recovery":
        assert not event.interruptions  # lost before the plan: planned with the rest
    else:
        assert event.interruptions, event
    assert_equal_states(controller.final_states, oracle)  # type: ignore[attr-defined]


def test_an_interrupted_rollback_is_planned_again_and_ends_exact() -> None:
    """Both replicas of stage 0 lost: everyone rolls back to the peer snapshot of step 2;
    the replacement for (0,0) dies while it receives its snapshot from its buddy."""
    top, steps = Topology(2, 2), 5
    clean, _ = make(mlp_spec(), top)
    drive(clean)
    controller, group = make(
        mlp_spec(),
        top,
        Kill(step=3, stage=0, replica=0),
        Kill(step=3, stage=0, replica=1),
        policy=RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=2)),
    )
    group.chaos = once(top.rank(0, 0), "recv_snapshot")
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    (event,) = controller.events
    assert event.strategy == "rollback" and event.tier == "peer"
    assert [note.split(":")[0] for note in event.interruptions] == ["restoring"]
    assert len(controller.records) == steps + event.lost_steps
    assert_equal_states(controller.final_states, clean.final_states)  # type: ignore[attr-defined]


def test_a_recovery_that_keeps_failing_gives_up_with_a_recovery_error() -> None:
    """Every replacement dies while it is built: after MAX_INTERRUPTIONS, a RecoveryError
    that names the phase and the failure -- never a raw Ray/Gloo/store error."""
    controller, _ = run(lambda rank, method: 0.0 if method == "setup" else None)
    assert controller.phase is Phase.FAILED
    assert isinstance(controller.error, RecoveryError)
    assert f"{MAX_INTERRUPTIONS} failures during the recovery" in str(controller.error)
    assert "replacing" in str(controller.error)


def test_a_recovery_gives_up_on_one_place_dying_again_or_calls_failing_with_all_alive() -> None:
    """`Failure.hopeless`, alone: deaths spread over ranks never; one rank's 8th death, or
    8 interruptions in a row that lost nobody, do -- and a death resets the quiet count."""
    from recovery.errors import RecoveryInterrupted
    from recovery.runtime.records import Failure

    def failure() -> Failure:
        return Failure(step=3, lost={0}, cause="killed", detected_at=0.0, struck_at=0.0,
                       errors={}, generation=0)  # fmt: skip

    def hit(f: Failure, lost: set[int]) -> str | None:
        f.interrupt("reforming", RecoveryInterrupted("x", lost=lost, broken={5}),
                    rebuilding=set(), survivors_restored=False)  # fmt: skip
        return f.hopeless(MAX_INTERRUPTIONS, TOP)

    spread = failure()
    assert [hit(spread, {i % 5}) for i in range(3 * MAX_INTERRUPTIONS)] == [None] * 24
    same = failure()
    assert [hit(same, {1}) for _ in range(MAX_INTERRUPTIONS)][-2:] == [
        None, f"worker {TOP.worker(1)}'s new workers died {MAX_INTERRUPTIONS} times"
    ]  # fmt: skip
    quiet = failure()
    assert [hit(quiet, set()) for _ in range(MAX_INTERRUPTIONS - 1)] == [None] * 7
    assert hit(quiet, {2}) is None and hit(quiet, set()) is None  # a death: counting anew
    for _ in range(MAX_INTERRUPTIONS - 2):
        hit(quiet, set())
    assert (
        hit(quiet, set()) == f"{MAX_INTERRUPTIONS} interruptions in a row with every worker alive"
    )


def test_deaths_spread_over_the_job_never_make_it_give_up(oracle) -> None:  # type: ignore[no-untyped-def]
    """Outside kills faster than the recovery (found by scripts/chaos.py without spares): a
    worker of three places dies in turn while the groups form, 14 deaths, more interruptions
    than MAX_INTERRUPTIONS but none of the three places near it. A replica of every stage
    lives throughout, so the job goes on and ends exact (before, it gave up at 8)."""
    places = [LOST, TOP.rank(0, 0), TOP.rank(0, 1)]  # (0,2) keeps stage 0's state
    kills: list[tuple[int, int]] = []  # (rank, the failure's interruptions so far)
    controller, group = make(mlp_spec(), TOP, FIRST, nodes=3)

    lock = threading.Lock()

    def rule(rank: int, method: str) -> float | None:  # one death per attempt
        failure = controller.failure
        attempt = len(failure.interruptions) if failure is not None else -1
        with lock:
            if method != "join" or len(kills) == 14 or (kills and kills[-1][1] == attempt):
                return None
            if rank == places[len(kills) % len(places)]:
                kills.append((rank, attempt))
                return 0.0
        return None

    group.chaos = rule
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    assert len(kills) == 14
    (event,) = controller.events
    assert len(event.interruptions) > MAX_INTERRUPTIONS, event.interruptions
    assert_equal_states(controller.final_states, oracle)  # type: ignore[attr-defined]


@pytest.mark.parametrize("victim", [TOP.rank(0, 0), TOP.rank(1, 2)], ids=["(0,0)", "(1,2)"])
def test_a_death_while_taking_peer_snapshots_is_recovered_exactly(oracle, victim: int) -> None:  # type: ignore[no-untyped-def]
    """A worker killed while the job takes its peer snapshots after a commit (found by
    scripts/chaos.py): the step stays committed, the worker is rebuilt, and the job ends
    bit-identical -- before, `fit` raised RecoveryInterrupted ("could not take peer
    snapshots") and the job died."""
    controller, group = make(
        mlp_spec(), TOP, policy=RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=2)), nodes=3
    )
    group.chaos = once(victim, "take_snapshot")
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    (event,) = controller.events
    assert event.step == 2 and TOP.worker(victim) in {
        TOP.worker(TOP.rank(s, r)) for s, r in event.lost
    }
    assert event.strategy == "replica_copy"
    assert [r.step for r in controller.records] == list(range(5))
    assert_equal_states(controller.final_states, oracle)  # type: ignore[attr-defined]
