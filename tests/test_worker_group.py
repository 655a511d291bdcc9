"""One conformance test for every `WorkerGroup`: Ray actors and threads behave the same."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from recovery.groups import ThreadWorkerGroup, WorkerGroup, WorkerLost
from tests.workloads import EchoWorker


def _thread_group() -> WorkerGroup:
    return ThreadWorkerGroup(EchoWorker, nodes=["node-a", "node-b"])


def _ray_group() -> WorkerGroup:
    from recovery.groups.ray_env import connect
    from recovery.groups.ray_group import RayWorkerGroup

    connect()
    return RayWorkerGroup(EchoWorker)


@pytest.fixture(params=["threads", pytest.param("ray", marks=pytest.mark.ray)])
def group(request: pytest.FixtureRequest) -> Iterator[WorkerGroup]:
    made = _thread_group() if request.param == "threads" else _ray_group()
    yield made
    made.shutdown(clean=False)


def _place(group: WorkerGroup, ranks: int) -> dict[int, str]:
    nodes = group.nodes()
    return {r: nodes[r % len(nodes)] for r in range(ranks)}


def test_start_call_and_results(group: WorkerGroup) -> None:
    placement = _place(group, 3)
    started, warm = group.start(placement, timeout=60)
    assert not started.lost and warm == set()
    assert group.ranks() == [0, 1, 2]
    for rank, node in placement.items():
        assert group.info(rank).node_id == node and group.info(rank).host
    got = group.call(EchoWorker.echo, args=lambda r: (r * 10,), timeout=30)
    assert got.results == {0: 0, 1: 10, 2: 20} and not got.lost


def test_a_killed_worker_is_lost_and_user_errors_are_raised_as_themselves(
    group: WorkerGroup,
) -> None:
    group.start(_place(group, 2), timeout=60)
    group.kill([1])
    assert group.ranks() == [0]
    call = group.submit(1, EchoWorker.echo, 1)
    group.wait([call], 5)
    with pytest.raises(WorkerLost):
        group.result(call)
    boom = group.submit(0, EchoWorker.boom)
    group.wait([boom], 30)
    with pytest.raises(KeyError, match="user code failed"):
        group.result(boom)
    assert group.call(EchoWorker.echo, args=lambda r: ("alive",), timeout=30).results == {
        0: "alive"
    }


def test_wait_first_timeouts_and_the_control_thread(group: WorkerGroup) -> None:
    group.start(_place(group, 2), timeout=60)
    group.call(EchoWorker.echo, args=lambda r: (0,), timeout=30)  # both warm
    slow, fast = group.submit(0, EchoWorker.nap, 3.0), group.submit(1, EchoWorker.nap, 0.0)
    finished, pending = group.wait([slow, fast], 10, first=True)
    assert finished == [fast] and pending == [slow]
    started = time.monotonic()
    probe = group.submit(0, EchoWorker.probe)  # answered while the main thread naps
    group.wait([probe], 2)
    assert group.result(probe)["step"] == 0 and time.monotonic() - started < 2
    with pytest.raises(WorkerLost, match="in time"):
        group.result(slow)  # not finished yet: a timeout reads as a lost worker
    assert group.gather({"s": slow}, 10).results == {"s": 3.0}


def test_spares_are_warmed_and_taken_on_their_node(group: WorkerGroup) -> None:
    nodes = group.nodes()
    group.add_spares([nodes[0]], lambda: (EchoWorker.echo, ("warm",)))
    assert group.spare_count() == 1
    assert group.await_spares(60) == 1
    started, warm = group.start({0: nodes[0], 1: nodes[-1]}, timeout=60, spares=True)
    assert not started.lost and warm == {0} and group.spare_count() == 0
    assert group.info(0).node_id == nodes[0]


def test_restarting_a_rank_replaces_its_worker(group: WorkerGroup) -> None:
    group.start(_place(group, 1), timeout=60)
    first = group.info(0).pid
    group.start(_place(group, 1), timeout=60)
    assert group.ranks() == [0]
    assert group.call(EchoWorker.echo, args=lambda r: ("again",), timeout=30).results == {
        0: "again"
    }
    if isinstance(group, ThreadWorkerGroup):
        assert group.started == 2 and first == group.info(0).pid  # one process, two workers


def test_the_frames_of_a_killed_thread_are_read_with_the_collector_held_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`sys._current_frames` can deadlock the process if the garbage collector runs inside
    it (cpython#106883, before 3.11.9; `thread_group.current_frames`). A thread job with a
    worker hung mid-pipeline kills that worker's thread in the middle of a call, and its
    frames are read with the collector off -- and it is on again after."""
    import gc
    import sys

    from parallelism import Topology
    from recovery import Hang, KillPoint, RecoveryPolicy, Timeouts
    from recovery.groups import thread_group
    from tests.jobs import drive, make
    from tests.workloads import mlp_spec

    real, seen = sys._current_frames, []

    def spy():  # type: ignore[no-untyped-def]
        seen.append(gc.isenabled())
        return real()

    monkeypatch.setattr(thread_group.sys, "_current_frames", spy)
    assert gc.isenabled()
    stuck = Hang(step=2, stage=1, replica=1, at=KillPoint.MID_PIPELINE)
    policy = RecoveryPolicy(timeouts=Timeouts(hang=1.0))
    controller, _ = make(mlp_spec(), Topology(2, 2), stuck, policy=policy)
    drive(controller)
    (event,) = controller.events
    assert event.cause == "hung"  # killed in the middle of a call
    assert seen and not any(seen), seen
    assert gc.isenabled()
    gc.disable()
    try:
        thread_group.current_frames()
        assert not gc.isenabled()  # left as it found it
    finally:
        gc.enable()
