from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism import Topology
from recovery.groups.placement import place, replacement_node


@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 6))
def test_replicas_of_a_stage_spread_over_nodes(stages: int, replicas: int, n_nodes: int) -> None:
    top = Topology(stages, replicas)
    nodes = [f"n{i}" for i in range(n_nodes)]
    assignment = place(top, nodes)
    assert set(assignment) == set(range(top.world_size))
    for s in range(stages):
        used = {assignment[r] for r in top.stage_group(s)}
        assert len(used) == min(replicas, n_nodes)
    for r in range(replicas):  # a pipeline stays on one node
        assert len({assignment[x] for x in top.pipeline(r)}) == 1


@given(st.integers(2, 6), st.integers(2, 4), st.integers(2, 5), st.data())
def test_replacement_avoids_siblings_when_its_node_is_gone(
    stages: int, replicas: int, n_nodes: int, data: st.DataObject
) -> None:
    top = Topology(stages, replicas)
    nodes = [f"n{i}" for i in range(n_nodes)]
    assignment = place(top, nodes)
    rank = data.draw(st.integers(0, top.world_size - 1))
    dead = assignment[rank]
    alive = [n for n in nodes if n != dead]
    node = replacement_node(top, rank, assignment, alive)
    assert node in alive
    siblings = {assignment[r] for r in top.stage_group(top.worker(rank).stage) if r != rank}
    if set(alive) - siblings:
        assert node not in siblings
    # its own node, when alive, is preferred
    assert replacement_node(top, rank, assignment, nodes) == dead


def test_no_nodes() -> None:
    with pytest.raises(ValueError, match="no alive Ray node"):
        place(Topology(2, 2), [])
    with pytest.raises(ValueError, match="no alive Ray node"):
        replacement_node(Topology(2, 2), 0, {0: "a"}, [])


@given(
    stages=st.integers(1, 3),
    replicas=st.integers(2, 3),
    n_nodes=st.integers(2, 4),
    data=st.data(),
)
def test_a_spare_is_used_only_where_the_stage_has_no_other_replica(
    stages: int, replicas: int, n_nodes: int, data: st.DataObject
) -> None:
    top = Topology(stages, replicas)
    nodes = [f"n{i}" for i in range(n_nodes)]
    assignment = place(top, nodes)
    rank = data.draw(st.integers(0, top.world_size - 1))
    alive = data.draw(st.lists(st.sampled_from(nodes), min_size=1, unique=True))
    spares = {n: data.draw(st.integers(0, 2)) for n in nodes}
    node = replacement_node(top, rank, assignment, alive, spares)
    stage = top.worker(rank).stage
    siblings = {assignment[r] for r in top.stage_group(stage) if r != rank}
    allowed = [n for n in alive if n not in siblings]
    assert node in alive
    if allowed:
        assert node not in siblings  # a spare never pulls two replicas onto one node
        if any(spares[n] for n in allowed):
            assert spares[node] > 0  # a warm start wherever the rule allows one


def test_a_replacement_takes_the_spare_on_an_allowed_node() -> None:
    top = Topology(2, 3)  # ranks 0..5; stage s, replica r = rank r * 2 + s
    assignment = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    # Node a is lost; d has a spare, b has one too (but b holds stage 0's replica 1).
    assert replacement_node(top, 0, assignment, ["b", "c", "d"], {"b": 1, "d": 1}) == "d"
    assert replacement_node(top, 0, assignment, ["b", "c", "d"], {"b": 1}) == "d"  # cold, apart
    # The process died, its node is fine, a spare waits elsewhere on an allowed node.
    assert replacement_node(top, 0, assignment, ["a", "b", "c", "d"], {"d": 1}) == "d"
    assert replacement_node(top, 0, assignment, ["a", "b", "c", "d"], {"a": 1, "d": 1}) == "a"
