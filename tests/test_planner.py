"""Planner invariants over random topologies and lost sets (docs/DESIGN.md, Recovery hierarchy)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism import Topology
from recovery.errors import RedundancyExhausted
from recovery.planner import REPLICA_COPY, RESTART, Redundancy, plan
from recovery.policy import RecoveryPolicy


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
        assert action.strategy == REPLICA_COPY and len(action.sources) == 1
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
    result = plan(top, lost, Redundancy(redundancy.alive, tuple(checkpoints)), RecoveryPolicy(strategy="restart"))
    if not lost:
        assert result.actions == ()
        return
    assert sorted(a.rank for a in result.actions) == list(range(top.world_size))
    assert {a.strategy for a in result.actions} == {RESTART}
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
    with pytest.raises(ValueError, match="unknown recovery strategy"):
        RecoveryPolicy(strategy="pray")
    with pytest.raises(ValueError, match="hot_spares"):
        RecoveryPolicy(hot_spares=-1)
    with pytest.raises(ValueError, match="hang_timeout_s"):
        RecoveryPolicy(hang_timeout_s=0)
    with pytest.raises(ValueError, match="checkpoint_every"):
        RecoveryPolicy(checkpoint_every=0)
