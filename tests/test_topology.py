from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism import Topology, Worker


@given(st.integers(1, 16), st.integers(1, 16))
def test_rank_round_trip_and_groups(stages: int, replicas: int) -> None:
    top = Topology(stages, replicas)
    assert top.world_size == stages * replicas
    seen = set()
    for rank in range(top.world_size):
        w = top.worker(rank)
        assert top.rank(w.stage, w.replica) == rank
        seen.add(w)
    assert seen == set(top.workers())
    for s in range(stages):
        group = top.stage_group(s)
        assert len(group) == replicas and {top.worker(r).stage for r in group} == {s}
    for r in range(replicas):
        pipe = top.pipeline(r)
        assert [top.worker(x).stage for x in pipe] == list(range(stages))
        assert pipe == list(range(r * stages, (r + 1) * stages))  # a pipeline is contiguous


def test_neighbours() -> None:
    top = Topology(4, 2)
    assert top.neighbours(0) == (None, 1)
    assert top.neighbours(2) == (1, 3)
    assert top.neighbours(3) == (2, None)
    assert Topology(1).neighbours(0) == (None, None)
    assert str(top) == "4x2" and str(Worker(1, 0)) == "(1,0)"


@pytest.mark.parametrize(
    "stages, replicas", [(0, 1), (1, 0), (-2, 1), (2.5, 1), ("4", 2), (True, 1), (None, 1)]
)
def test_rejects_impossible_topologies(stages: object, replicas: object) -> None:
    with pytest.raises(ValueError, match="must be a positive integer"):
        Topology(stages, replicas)  # type: ignore[arg-type]


def test_rejects_out_of_range_coordinates() -> None:
    top = Topology(2, 2)
    with pytest.raises(ValueError, match="stage 2"):
        top.rank(2, 0)
    with pytest.raises(ValueError, match="replica 3"):
        top.rank(0, 3)
    with pytest.raises(ValueError, match="rank 4"):
        top.worker(4)
