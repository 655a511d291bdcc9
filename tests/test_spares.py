"""Hot spares on Ray that die, or never warm up, never stand in for a worker (issue 13).

A spare can die while it waits (its node's OOM killer, an operator's kill), or fail its
warm-up. Either way the next replacement must start a fresh actor rather than hand a dead
one to the recovery, and a spare that failed must not stay alive holding its resources.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import ray

from recovery.groups.ray_group import RayWorkerGroup
from tests.test_worker_group import _ray_group
from tests.workloads import EchoWorker

pytestmark = [pytest.mark.ray]


@pytest.fixture
def group() -> Iterator[RayWorkerGroup]:
    made = _ray_group()
    assert isinstance(made, RayWorkerGroup)
    yield made
    made.shutdown(clean=False)


def _dead(actor: object, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.echo.remote(1), timeout=5)  # type: ignore[attr-defined]
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


def test_a_spare_that_died_while_waiting_is_replaced_by_a_fresh_worker(
    group: RayWorkerGroup,
) -> None:
    node = group.nodes()[0]
    group.add_spares([node], lambda: (EchoWorker.echo, ("warm",)))
    assert group.await_spares(60) == 1
    spare = group._spares[0][0]
    pid = ray.get(spare.info.remote(), timeout=30).pid
    os.kill(pid, signal.SIGKILL)  # from outside: the group is not told
    assert _dead(spare)
    started, warm = group.start({0: node}, timeout=60, spares=True)
    assert not started.lost and not started.unplaced
    assert warm == set()  # the dead spare was not counted as a warm start
    assert group.info(0).pid != pid
    assert group.call(EchoWorker.echo, args=lambda r: ("again",), timeout=30).results == {
        0: "again"
    }


def _pid_running(title: str, within_s: float = 30.0) -> int:
    """The pid of the process whose command line (Ray's process title) contains ``title``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if title.encode() in f.read():
                            return int(entry)
                except OSError:
                    continue
        time.sleep(0.05)
    raise AssertionError(f"no process {title!r}")


def test_a_spare_that_dies_in_its_warm_up_is_dropped_and_not_used(group: RayWorkerGroup) -> None:
    node = group.nodes()[0]
    group.add_spares([node], lambda: (EchoWorker.nap, (3600.0,)))  # warming up for an hour
    os.kill(_pid_running("RemoteEchoWorker.nap"), signal.SIGKILL)
    assert group.await_spares(60) == 0
    assert group.spare_count() == 0
    started, warm = group.start({0: node}, timeout=60, spares=True)
    assert not started.lost and warm == set()
    assert group.call(EchoWorker.echo, args=lambda r: ("again",), timeout=30).results == {
        0: "again"
    }
