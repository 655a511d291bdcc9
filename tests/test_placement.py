from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism import Topology
from recovery.placement import place, replacement_node


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
