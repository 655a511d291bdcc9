"""Elastic shrink and grow (recovery/runtime/elastic.py, [Note: elastic shrink]).

The pure part -- who computes which replica's microbatches in a shrunk generation, and
which recoveries may shrink -- is checked over every set of missing workers. The rest
drives real jobs over threads (`ThreadWorkerGroup` with ``slots``, so a node can be full):
a kill or a node loss with no room shrinks the job, which trains on the complete pipelines
with the same global batch and grows back once a replacement is ready; with two replicas
the losses and final states are bit-identical to a run that never failed.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism import Topology
from recovery import Kill, RecoveryPolicy
from recovery.errors import PlacementFailed
from recovery.groups import ThreadWorkerGroup
from recovery.names import Strategy
from recovery.planner import RecoveryAction, RecoveryPlan
from recovery.reference import differences
from recovery.runtime import Controller, Phase
from recovery.runtime.elastic import complete_replicas, shares, shrinkable
from tests.jobs import drive, make
from tests.workloads import mlp_spec

STEPS = 16
STATE_RTOL = 1e-4
"""How close a job that shrank with three replicas ends to the run that never failed, each
tensor by the norm of its difference (scripts/chaos.py holds jobs to the same)."""


# -- pure ----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    stages=st.integers(1, 4),
    replicas=st.integers(2, 4),
    data=st.data(),
)
def test_every_replicas_microbatches_are_computed_once_per_stage(
    stages: int, replicas: int, data: st.DataObject
) -> None:
    """In a generation without ``missing``, each stage's present workers together compute
    every replica's share exactly once, a complete pipeline's workers all compute the same
    shares, its own first, and a live worker of an incomplete pipeline computes none."""
    top = Topology(stages, replicas)
    missing = data.draw(st.sets(st.integers(0, top.world_size - 1), min_size=1))
    complete = complete_replicas(top, missing)
    if not complete:
        with pytest.raises(ValueError, match="no pipeline replica is complete"):
            shares(top, missing)
        return
    roles = shares(top, missing)
    assert set(roles) == set(range(top.world_size)) - missing
    for stage in range(stages):
        computed = [r for rank in top.stage_group(stage) if rank in roles for r in roles[rank]]
        assert sorted(computed) == list(range(replicas))
    for replica in range(replicas):
        present = [roles[rank] for rank in top.pipeline(replica) if rank in roles]
        if replica in complete:
            assert all(p == present[0] for p in present) and present[0][0] == replica
        else:
            assert all(p == () for p in present)


def test_nothing_is_missing_without_a_shrink() -> None:
    assert shares(Topology(2, 2), set()) == {}


def _plan(*actions: RecoveryAction) -> RecoveryPlan:
    return RecoveryPlan(actions=actions, resume_step=3)


def test_only_replica_copies_of_the_lost_with_a_complete_pipeline_left_may_shrink() -> None:
    top = Topology(2, 2)
    copy = _plan(RecoveryAction(1, Strategy.REPLICA_COPY, (3,)))
    assert shrinkable(top, copy, {1})
    rollback = _plan(*(RecoveryAction(r, Strategy.ROLLBACK) for r in range(4)))
    assert not shrinkable(top, rollback, {1})  # survivors are restored too
    average = _plan(RecoveryAction(1, Strategy.NEIGHBOR_AVERAGE, (0,)))
    assert not shrinkable(top, average, {1})  # an approximate rebuild is not skipped
    both = _plan(
        RecoveryAction(1, Strategy.REPLICA_COPY, (3,)),
        RecoveryAction(2, Strategy.REPLICA_COPY, (0,)),
    )
    assert not shrinkable(top, both, {1, 2})  # no pipeline would be complete
    assert not shrinkable(top, _plan(), set())


# -- jobs over threads ------------------------------------------------------------------


def _job(
    top: Topology,
    *faults: object,
    policy: RecoveryPolicy | None = None,
    slots: int | None = None,
) -> tuple[Controller, ThreadWorkerGroup]:
    """A started job on threads: a node per replica, ``slots`` workers a node."""
    return make(
        mlp_spec(), top, *faults, policy=policy, nodes=top.replicas, steps=STEPS, slots=slots
    )


@pytest.fixture(scope="module")
def oracles() -> dict[int, tuple[list[float], dict]]:  # type: ignore[type-arg]
    """Losses and final states of failure-free runs, per replica count (2 and 3 replicas)."""
    out = {}
    for replicas in (2, 3):
        controller, _ = _job(Topology(2, replicas))
        drive(controller)
        out[replicas] = ([r.loss for r in controller.records], controller.final_states)  # type: ignore[attr-defined]
    return out


def _node_loss_and_return(
    controller: Controller, group: ThreadWorkerGroup, *, lose_at: int, shrunk_for: int
) -> list[Phase]:
    """Drive the job; lose node-0 once ``lose_at`` steps are committed, and add a node once
    the job trained ``shrunk_for`` steps after its first shrink. (The workers may commit
    several steps in one call, `_batch`, so the loss is found at a step ``>= lose_at`` --
    up to a batch later: the tests lose the node early, while batches are one step.)"""
    phases = []
    try:
        while controller.phase not in (Phase.FINISHED, Phase.FAILED):
            if controller.phase is Phase.RUNNING:
                if controller.step >= lose_at and "node-0" in group.nodes():
                    group.remove_node("node-0")
                shrunk = [e.step for e in controller.events if "shrink" in e.strategy]
                if (
                    shrunk
                    and controller.step >= shrunk[0] + shrunk_for
                    and "node-new" not in group.nodes()
                ):
                    group.add_node("node-new")
            phases.append(controller.advance())
        controller.final_states = controller.states() if controller.phase is Phase.FINISHED else {}  # type: ignore[attr-defined]
    finally:
        controller.shutdown()
    return phases


def test_a_node_loss_with_no_room_shrinks_trains_on_and_grows_back_bit_for_bit(oracles) -> None:  # type: ignore[no-untyped-def]
    """2x2, every node full: losing node-0 loses pipeline 0, and its replacements find no
    room. The job shrinks at once -- pipeline 1 computes both replicas' microbatches --
    trains on, and grows back when a node joins; every loss and the final state of every
    worker are those of the run that never failed."""
    losses, states = oracles[2]
    controller, group = _job(Topology(2, 2), policy=RecoveryPolicy(elastic=True), slots=2)
    _node_loss_and_return(controller, group, lose_at=1, shrunk_for=4)
    assert controller.phase is Phase.FINISHED, controller.error
    shrink, grow = controller.events
    assert (shrink.strategy, shrink.lost) == ("shrink", [(0, 0), (1, 0)])
    assert shrink.step >= 1
    assert (grow.strategy, grow.cause) == ("grow", "grow")
    assert grow.step >= shrink.step + 4
    assert grow.lost == [(0, 0), (1, 0)]
    assert {a["sources"][0] for a in grow.actions} == {(0, 1), (1, 1)}
    shrunk = [r for r in controller.records if shrink.step <= r.step < grow.step]
    assert len(shrunk) >= 4  # it really trained shrunk
    assert [r.loss for r in controller.records] == losses
    _assert_equal(controller.final_states, states)  # type: ignore[attr-defined]


def _hold_spares(controller: Controller, group: ThreadWorkerGroup, steps: int) -> None:
    """Keep the spares warming up until the job has trained ``steps`` steps shrunk (a thread
    spare is ready at once: the shrink and the grow would fall on one step boundary)."""
    gate = threading.Event()
    group.spare_gate = gate

    def on_step(record: object) -> None:
        shrunk = [e.step for e in controller.events if "shrink" in e.strategy]
        if shrunk and controller.step >= shrunk[0] + steps:
            gate.set()

    controller.on_step = on_step


def test_a_kill_without_a_warm_spare_shrinks_at_once_and_ends_exact(oracles) -> None:  # type: ignore[no-untyped-def]
    """With room but no spare ready, survivors do not wait for a cold start: the job shrinks,
    trains shrunk -- pipeline 1 computing pipeline 0's microbatches too -- and grows back
    when the replacement (asked for as a spare) is warm."""
    losses, states = oracles[2]
    controller, group = _job(
        Topology(2, 2), Kill(step=2, stage=1, replica=0), policy=RecoveryPolicy(elastic=True)
    )
    _hold_spares(controller, group, 4)
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    shrink, grow = controller.events
    assert (shrink.strategy, grow.strategy) == ("shrink", "grow")
    assert grow.step - shrink.step >= 4  # four steps really ran shrunk
    assert [r.loss for r in controller.records] == losses
    _assert_equal(controller.final_states, states)  # type: ignore[attr-defined]


def test_a_ready_hot_spare_replaces_without_a_shrink(oracles) -> None:  # type: ignore[no-untyped-def]
    losses, states = oracles[2]
    controller, _ = _job(
        Topology(2, 2),
        Kill(step=2, stage=1, replica=0),
        policy=RecoveryPolicy(elastic=True, hot_spares=1),
    )
    drive(controller)
    assert [e.strategy for e in controller.events] == ["replica_copy"]
    assert [r.loss for r in controller.records] == losses
    _assert_equal(controller.final_states, states)  # type: ignore[attr-defined]


def test_three_replicas_shrunk_stay_within_rounding_and_equal_to_each_other(oracles) -> None:  # type: ignore[no-untyped-def]
    """With three replicas the shrunk sum runs in another order than Gloo's ring: the losses
    stay within 1e-6 relative of the failure-free run, and the replicas of every stage end
    bit-identical to each other."""
    losses, _ = oracles[3]
    controller, group = _job(Topology(2, 3), policy=RecoveryPolicy(elastic=True), slots=2)
    _node_loss_and_return(controller, group, lose_at=1, shrunk_for=4)
    assert [e.strategy for e in controller.events] == ["shrink", "grow"]
    got = [r.loss for r in controller.records]
    assert len(got) == len(losses)
    for a, b in zip(got, losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    final = controller.final_states  # type: ignore[attr-defined]
    for stage in range(2):
        first = final[(stage, 0)]["model"]
        for replica in (1, 2):
            for name, value in final[(stage, replica)]["model"].items():
                assert torch.equal(value, first[name]), (stage, replica, name)


def test_a_second_loss_while_shrunk_shrinks_further_and_ends_exact(oracles) -> None:  # type: ignore[no-untyped-def]
    """3 replicas, node-0 lost (pipeline 0 missing), then a worker of pipeline 1 killed while
    shrunk: pipeline 2 computes all three shares until room returns."""
    losses, _ = oracles[3]
    controller, group = _job(
        Topology(2, 3),
        Kill(step=5, stage=0, replica=1),
        policy=RecoveryPolicy(elastic=True),
        slots=2,
    )
    _node_loss_and_return(controller, group, lose_at=1, shrunk_for=5)
    assert controller.phase is Phase.FINISHED, controller.error
    strategies = [e.strategy for e in controller.events]
    assert strategies[:2] == ["shrink", "shrink"] and strategies[-1] == "grow", strategies
    assert controller.events[1].lost == [(0, 0), (1, 0), (0, 1)]  # in rank order
    got = [r.loss for r in controller.records]
    for a, b in zip(got, losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    final = controller.final_states  # type: ignore[attr-defined]
    found = differences(final, oracles[3][1], rtol=STATE_RTOL)  # every worker, every tensor
    assert not found, found[:5]
    for stage in range(2):  # and the replicas of each stage bit-identical to each other
        models = [final[(stage, r)] for r in range(3)]
        assert all(not differences(m, models[0]) for m in models[1:]), stage


def test_without_elastic_no_room_is_a_placement_failure_naming_the_workers() -> None:
    controller, group = _job(Topology(2, 2), slots=2)
    _node_loss_and_return(controller, group, lose_at=1, shrunk_for=99)
    assert controller.phase is Phase.FAILED
    error = controller.error
    assert isinstance(error, PlacementFailed), error
    assert sorted(error.unplaced) == [0, 1]
    assert "worker (0,0)" in str(error) and "no room on node" in str(error)


def _no_shared(stage: int, stages: int) -> list[str]:
    return []


@pytest.mark.parametrize(
    ("policy", "top", "spec", "match"),
    [
        (dict(elastic=True), Topology(2, 1), {}, "two or more pipeline replicas"),
        (dict(elastic=True), Topology(2, 2), dict(shared_params=_no_shared), "between stages"),
        (dict(elastic=True), Topology(2, 2), dict(shard_optimizer=True), r"ZeRO-1"),
    ],
)
def test_what_cannot_shrink_is_refused_before_anything_starts(policy, top, spec, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        make(mlp_spec(**spec), top, policy=RecoveryPolicy(**policy))


def test_elastic_is_a_bool() -> None:
    with pytest.raises(ValueError, match="elastic must be True or False"):
        RecoveryPolicy(elastic="yes")


def _assert_equal(got: dict, want: dict) -> None:  # type: ignore[type-arg]
    assert got.keys() == want.keys()
    for key, state in want.items():
        for part in ("model", "optimizer"):
            ours = torch.utils._pytree.tree_leaves(got[key][part])
            theirs = torch.utils._pytree.tree_leaves(state[part])
            assert len(ours) == len(theirs)
            for a, b in itertools.zip_longest(ours, theirs):
                if isinstance(b, torch.Tensor):
                    assert torch.equal(a, b), (key, part)
                else:
                    assert a == b, (key, part)


def _deaths_while_elastic() -> list[tuple[int, str]]:
    """(victim, call) pairs that strike a 2x3 job shrunk without (1,0): any present worker
    leaving a generation or joining one (the shrink, the grow), or running a shrunk step;
    and the grow's source, (1,1), sending (1,0) its state."""
    top = Topology(2, 3)
    others = [r for r in range(top.world_size) if r != top.rank(1, 0)]
    pairs = [(v, m) for m in ("prepare_recovery", "join", "run_step") for v in others]
    return [*pairs, (top.rank(1, 1), "send_state")]


@pytest.mark.parametrize(("victim", "method"), _deaths_while_elastic())
def test_a_death_during_a_shrink_or_a_grow_is_recovered(oracles, victim: int, method: str) -> None:  # type: ignore[no-untyped-def]
    """2x3, (1,0) killed, no spare: while the job shrinks, trains shrunk or grows back,
    another worker dies at its next call of ``method`` (from outside, unknown to the
    controller). The recovery re-plans with the grown loss and the job finishes, every loss
    within 1e-6 relative of the run that never failed, the replicas equal to each other."""
    losses, states = oracles[3]
    controller, group = _job(
        Topology(2, 3), Kill(step=2, stage=1, replica=0), policy=RecoveryPolicy(elastic=True)
    )
    _hold_spares(controller, group, 3)
    fired: list[tuple[int, str, str]] = []

    def once(rank: int, called: str) -> float | None:
        # only once the job is shrinking, shrunk or growing: (1,0) lost or missing
        elastic = controller.failure is not None or controller.members.missing
        if rank == victim and called == method and elastic and not fired:
            fired.append((rank, called, controller.phase.value))
            return 0.0
        return None

    group.chaos = once
    drive(controller)
    assert len(fired) == 1, fired
    assert controller.phase is Phase.FINISHED, controller.error
    assert "shrink" in controller.events[0].strategy  # (a spare ready meanwhile: +replica_copy)
    top = Topology(2, 3)
    assert any(
        top.worker(victim) == top.worker(top.rank(*w)) for e in controller.events for w in e.lost
    )
    got = [r.loss for r in controller.records]
    assert len(got) == len(losses)
    for a, b in zip(got, losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    final = controller.final_states  # type: ignore[attr-defined]
    held = {key: final[key] for key in final}
    found = differences(held, {k: v for k, v in states.items() if k in held}, rtol=STATE_RTOL)
    assert not found, found[:5]
    for stage in range(2):  # a job may end shrunk: the workers there
        models = [final[key] for key in sorted(final) if key[0] == stage]
        for model in models[1:]:
            assert not differences(model, models[0]), stage


def test_two_lost_and_one_spare_ready_one_comes_back_at_once_the_other_later(oracles) -> None:  # type: ignore[no-untyped-def]
    """2x3 with one hot spare: (1,0) and (0,1) die in the same step. The spare takes one of
    them in the same recovery that leaves the other out; the other grows back later."""
    losses, _ = oracles[3]
    controller, _ = _job(
        Topology(2, 3),
        Kill(step=2, stage=1, replica=0),
        Kill(step=2, stage=0, replica=1),
        policy=RecoveryPolicy(elastic=True, hot_spares=1),
    )
    _drive_waiting_for_spares(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    first = controller.events[0]
    assert first.strategy == "replica_copy+shrink", first.strategy
    back = [a for a in first.actions if a["strategy"] == "replica_copy"]
    assert len(back) == 1 and back[0]["warm"]
    assert any(e.strategy == "grow" for e in controller.events[1:])
    for a, b in zip([r.loss for r in controller.records], losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)


def _drive_waiting_for_spares(controller: Controller) -> None:
    """`drive`, but at each step boundary of a shrunk job wait (up to 10 s) until a missing
    worker's spare is ready: thread steps take milliseconds, a spare's warm-up longer."""
    import time

    try:
        while controller.phase not in (Phase.FINISHED, Phase.FAILED):
            missing = set(controller.members.missing)
            if controller.phase is Phase.RUNNING and missing:
                by = time.monotonic() + 10
                while not controller.members.warm_placement(missing) and time.monotonic() < by:
                    time.sleep(0.01)
            controller.advance()
        controller.final_states = controller.states() if controller.phase is Phase.FINISHED else {}  # type: ignore[attr-defined]
    finally:
        controller.shutdown()
