"""Planner invariants over random topologies and lost sets (docs/DESIGN.md, Recovery hierarchy)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism import Topology
from recovery.errors import RedundancyExhausted
from recovery.names import Strategy
from recovery.planner import Redundancy, plan
from recovery.policy import MirrorPolicy, RecoveryPolicy, RestartBaseline, Timeouts


@st.composite
def failures(draw: st.DrawFn) -> tuple[Topology, set[int], Redundancy]:
    top = Topology(draw(st.integers(1, 6)), draw(st.integers(1, 4)))
    lost = draw(st.sets(st.integers(0, top.world_size - 1)))
    step = draw(st.integers(0, 1000))
    alive = {r: step for r in range(top.world_size) if r not in lost}
    return top, lost, Redundancy(alive=alive)


@settings(max_examples=300, deadline=None)
@given(failures())
def test_replica_copy_plans(case: tuple[Topology, set[int], Redundancy]) -> None:
    top, lost, redundancy = case
    exhausted = any(set(top.stage_group(s)) <= lost for s in range(top.stages))
    if exhausted:
        with pytest.raises(RedundancyExhausted) as info:
            plan(top, lost, redundancy, RecoveryPolicy())
        for s in range(top.stages):  # the message names every exhausted stage
            if set(top.stage_group(s)) <= lost:
                assert f"stage {s} lost all" in str(info.value)
        return
    result = plan(top, lost, redundancy, RecoveryPolicy())
    targets = [a.rank for a in result.actions]
    assert sorted(targets) == sorted(lost)  # every lost worker exactly once, nobody else
    for action in result.actions:
        assert action.strategy == Strategy.REPLICA_COPY and len(action.sources) == 1
        (src,) = action.sources
        assert src in redundancy.alive and src not in lost  # alive, not itself rebuilt
        assert top.worker(src).stage == top.worker(action.rank).stage
    assert result.resume_step == max(redundancy.alive.values(), default=0)
    # copies are spread: no source serves more targets than needed
    for s in range(top.stages):
        mine = [a for a in result.actions if top.worker(a.rank).stage == s]
        if mine:
            live = len([r for r in top.stage_group(s) if r not in lost])
            per_source: dict[int, int] = {}
            for a in mine:
                per_source[a.sources[0]] = per_source.get(a.sources[0], 0) + 1
            assert max(per_source.values()) <= -(-len(mine) // live)


@given(failures(), st.lists(st.integers(1, 500), max_size=5))
def test_restart_plans_restore_everyone_from_the_newest_checkpoint(
    case: tuple[Topology, set[int], Redundancy], checkpoints: list[int]
) -> None:
    top, lost, redundancy = case
    result = plan(
        top,
        lost,
        Redundancy(redundancy.alive, tuple(checkpoints)),
        RecoveryPolicy(strategy="restart"),
    )
    if not lost:
        assert result.actions == ()
        return
    assert sorted(a.rank for a in result.actions) == list(range(top.world_size))
    assert {a.strategy for a in result.actions} == {Strategy.RESTART}
    assert result.resume_step == max(checkpoints, default=0)


def test_sources_only_at_the_highest_committed_step() -> None:
    top = Topology(2, 3)
    # replica 1 of stage 0 is behind: it must not be the source
    redundancy = Redundancy(alive={1: 5, 2: 4, 3: 5, 4: 5, 5: 5})
    result = plan(top, {0}, redundancy, RecoveryPolicy())
    assert result.actions[0].sources == (4,)


def test_inconsistent_input_is_rejected() -> None:
    top = Topology(2, 2)
    with pytest.raises(ValueError, match="both lost and alive"):
        plan(top, {0}, Redundancy(alive={0: 1, 1: 1, 2: 1, 3: 1}), RecoveryPolicy())
    with pytest.raises(ValueError, match="neither lost nor alive"):
        plan(top, {0}, Redundancy(alive={1: 1}), RecoveryPolicy())


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="strategy must be one of 'auto', 'restart'; got 'pray'"):
        RecoveryPolicy(strategy="pray")
    with pytest.raises(ValueError, match="hot_spares"):
        RecoveryPolicy(hot_spares=-1)
    with pytest.raises(ValueError, match=r"timeouts\.hang"):
        RecoveryPolicy(timeouts=Timeouts(hang=0))
    with pytest.raises(ValueError, match=r"baseline\.checkpoint_every"):
        RecoveryPolicy(baseline=RestartBaseline(checkpoint_every=0))


# -- the full hierarchy: approximate rebuilds and rollback -----------------------------------


@st.composite
def hierarchy_cases(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    top = Topology(draw(st.integers(1, 6)), draw(st.integers(1, 3)))
    lost = draw(st.sets(st.integers(0, top.world_size - 1), min_size=1))
    step = draw(st.integers(10, 100))
    alive = {r: step for r in range(top.world_size) if r not in lost}
    steps = st.sets(st.sampled_from([step - 10, step - 5, step]), max_size=2)
    own = {r: draw(steps) for r in range(top.world_size)}
    held = {
        h: {w: draw(steps) for w in draw(st.sets(st.integers(0, top.world_size - 1), max_size=2))}
        for h in range(top.world_size)
    }
    if draw(st.booleans()):  # snapshots on: every worker keeps step - 10, its buddy too
        world = top.world_size
        own = {r: {step - 10, *own[r]} for r in range(world)}
        for h in range(world):
            ward = (h + 1) % world
            held[h][ward] = {step - 10, *held[h].get(ward, ()), *draw(steps)}
    durable = tuple(draw(st.sets(st.sampled_from([step - 20, step - 10]), max_size=2)))
    policy = RecoveryPolicy(
        approximate=draw(st.sampled_from([None, "checkfree", "checkfree+"])),
        exact_only=draw(st.booleans()),
        allowed=draw(
            st.sampled_from(
                [
                    None,
                    ("replica_copy", "rollback"),
                    ("replica_copy", "neighbor_average", "edge_copy"),
                ]
            )
        ),
    )
    stand_ins = {}
    if draw(st.booleans()):  # replicated stages: a replica's snapshot restores any other
        stand_ins = {
            r: tuple(o for o in top.stage_group(top.worker(r).stage) if o != r)
            for r in range(top.world_size)
        }
    return (
        top,
        lost,
        Redundancy(
            alive=alive,
            peer_own=own,
            peer_held=held,
            durable_steps=durable,
            stand_ins=stand_ins,
        ),
        policy,
    )


def _has_other_source(top: Topology, stage: int, lost: set[int], policy: RecoveryPolicy) -> bool:
    """Brute force: can this stage be rebuilt without rolling back?"""
    dead = {s for s in range(top.stages) if set(top.stage_group(s)) <= lost}
    if stage not in dead:
        return policy.allows("replica_copy")
    if policy.exact_only or policy.approximate is None:
        return False
    if 0 < stage < top.stages - 1:
        return policy.allows("neighbor_average") and not {stage - 1, stage + 1} & dead
    partner = 1 if stage == 0 else top.stages - 2
    return (
        policy.approximate == "checkfree+"
        and policy.allows("edge_copy")
        and top.stages >= 4
        and partner not in dead
    )


def _rollback_steps(top: Topology, redundancy: Redundancy) -> tuple[set[int], set[int]]:
    """Brute force: the steps a peer-tier and a durable-tier rollback could resume at.

    A peer step must be restorable for every worker: from its own memory if it is alive, or
    from a live holder of its snapshot -- or of the snapshot of one of its stand-ins (a
    replica of its stage); what a dead worker held died with it.
    """
    alive = set(redundancy.alive)
    steps = {s for held in redundancy.peer_own.values() for s in held}
    steps |= {s for wards in redundancy.peer_held.values() for held in wards.values() for s in held}

    def survives(w: int, step: int) -> bool:
        return (w in alive and step in redundancy.peer_own.get(w, ())) or any(
            h in alive and step in wards.get(w, ()) for h, wards in redundancy.peer_held.items()
        )

    peer = set()
    for step in steps:
        if all(
            any(survives(c, step) for c in (w, *redundancy.stand_ins.get(w, ())))
            for w in range(top.world_size)
        ):
            peer.add(step)
    return peer, set(redundancy.durable_steps)


@settings(max_examples=200, deadline=None)
@given(hierarchy_cases())
def test_hierarchy_invariants(case) -> None:  # type: ignore[no-untyped-def]
    top, lost, redundancy, policy = case
    needs_rollback = any(
        not _has_other_source(top, top.worker(r).stage, lost, policy) for r in lost
    )
    peer_steps, durable_steps = _rollback_steps(top, redundancy)
    can_roll_back = policy.allows("rollback") and bool(peer_steps | durable_steps)
    try:
        result = plan(top, lost, redundancy, policy)
    except RedundancyExhausted:
        # exhausted only when some unit has no other allowed source and no snapshot could
        # serve a rollback of every worker
        assert needs_rollback and not can_roll_back, (peer_steps, durable_steps)
        return
    assert not needs_rollback or can_roll_back  # a plan only where the oracle finds one
    alive = set(redundancy.alive)
    assert (result.tier is not None) == needs_rollback  # rollback iff no other source
    if result.tier is not None:  # the newest step every worker can restore; peer on a tie
        newest = max(peer_steps | durable_steps)
        assert result.resume_step == newest, (result.resume_step, peer_steps, durable_steps)
        assert result.tier == ("peer" if newest in peer_steps else "durable")
    if policy.exact_only:
        assert result.exact
    if result.tier is None:
        assert sorted(a.rank for a in result.actions) == sorted(lost)
        for a in result.actions:
            assert set(a.sources) <= alive and not set(a.sources) & lost
        return
    # a rollback restores everyone, from a step that exists for every worker
    assert policy.allows("rollback")
    assert sorted(a.rank for a in result.actions) == list(range(top.world_size))
    for a in result.actions:
        assert a.strategy == "rollback"
        if result.tier == "durable":
            assert result.resume_step in redundancy.durable_steps
        elif a.sources:  # a holder's copy of it, or of a stand-in's (maybe the stand-in's own)
            (holder,) = a.sources
            copy = a.rank if a.copy_of is None else a.copy_of
            assert copy == a.rank or copy in redundancy.stand_ins[a.rank]
            held = redundancy.peer_held.get(holder, {}).get(copy, ())
            own = redundancy.peer_own.get(holder, ()) if holder == copy else ()
            assert holder in alive and result.resume_step in {*held, *own}, (a, redundancy)
        else:
            assert a.rank in alive and result.resume_step in redundancy.peer_own[a.rank]


# -- sharded state: ZeRO-1 optimizer shards and embedding-table shards ------------------------


@st.composite
def sharded_cases(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    top = Topology(draw(st.integers(1, 3)), draw(st.integers(2, 5)))
    lost = draw(st.sets(st.integers(0, top.world_size - 1), min_size=1))
    step = draw(st.integers(10, 100))
    alive = {r: step for r in range(top.world_size) if r not in lost}
    ring = {  # the next replica of the same stage mirrors each shard
        top.rank(s, r): top.rank(s, (r + 1) % top.replicas)
        for s in range(top.stages)
        for r in range(top.replicas)
    }
    stale = {r: draw(st.booleans()) for r in lost}
    redundancy = Redundancy(
        alive=alive,
        durable_steps=(step - 5,),
        mirror_holder=ring,
        mirror_stale=stale,
        pls=draw(st.sampled_from([0.0, 0.01, 0.2])),
    )
    policy = RecoveryPolicy(
        mirrors=MirrorPolicy(
            embedding=draw(st.sampled_from(["partial", "exact"])), pls_budget=0.05
        ),
        exact_only=draw(st.booleans()),
    )
    return top, lost, redundancy, policy


@settings(max_examples=200, deadline=None)
@given(sharded_cases())
def test_sharded_state_comes_back_from_its_mirror_or_everyone_rolls_back(case) -> None:  # type: ignore[no-untyped-def]
    top, lost, redundancy, policy = case
    partial_ok = not policy.exact_only and (
        redundancy.pls == 0 if policy.mirrors.embedding == "exact" else redundancy.pls <= 0.05
    )
    needs_rollback = any(
        redundancy.mirror_holder[r] in lost or (redundancy.mirror_stale[r] and not partial_ok)
        for r in lost
    )
    result = plan(top, lost, redundancy, policy)  # a durable snapshot: never exhausted
    assert (result.strategy == "rollback") == needs_rollback
    if needs_rollback:
        assert result.reason and sorted(a.rank for a in result.actions) == list(
            range(top.world_size)
        )
        return
    assert sorted(a.rank for a in result.actions) == sorted(lost)
    for a in result.actions:
        assert a.sources == (redundancy.mirror_holder[a.rank],)
        assert a.sources[0] not in lost  # never reads from a worker rebuilt in the same plan
        expected = "embedding_partial" if redundancy.mirror_stale[a.rank] else "shard_mirror"
        assert a.strategy == expected
    assert result.exact == (not any(redundancy.mirror_stale[r] for r in lost))
    if policy.exact_only:
        assert result.exact
