"""Shared fixtures: one local Ray for the whole session, test workloads shipped by value."""

from __future__ import annotations

import os
import sys

# Token auth is Ray's default for a new local cluster; a stale ~/.ray/auth_token must not
# decide whether the tests pass, so the tests run their clusters without it.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.pop("RAY_ADDRESS", None)

import pytest
import torch
from ray import cloudpickle

import tests.workloads

cloudpickle.register_pickle_by_value(tests.workloads)
torch.set_num_threads(1)


_EXIT_STATUS: list[int] = []


@pytest.fixture
def ray_local():
    """A local Ray on 127.0.0.1, started once and shared by the tests that use it."""
    from recovery.groups.ray_env import connect

    connect()
    yield


_TAKE_RAY_DOWN = ("cluster", "full_cluster")
"""Fixtures that shut the session's Ray down (a multi-node `ray.cluster_utils.Cluster` in
its place, torn down after)."""


def pytest_collection_modifyitems(session, config, items):  # type: ignore[no-untyped-def]
    """Run the tests that take the session's local Ray down (a cluster of their own, `ray
    stop`) last, in their order: every Ray test after one starts Ray and its workers again
    (10-20 s on 2 cores), so three of them spread through the run cost a minute."""
    last = [
        item
        for item in items
        if any(name in _TAKE_RAY_DOWN for name in getattr(item, "fixturenames", ()))
        or item.get_closest_marker("takes_ray_down") is not None
    ]
    if last:
        chosen = set(map(id, last))
        items[:] = [item for item in items if id(item) not in chosen] + last


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    _EXIT_STATUS.append(int(exitstatus))
    import ray

    if ray.is_initialized():
        from recovery.groups.pool import POOL

        POOL.clear()
        ray.shutdown()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):  # type: ignore[no-untyped-def]
    """End the test process with pytest's status once everything is reported, skipping the
    interpreter's finalization. The thread-group tests kill workers mid-call and leave daemon
    threads blocked inside Gloo (a wait on a group a dead peer will never finish, until
    Gloo's timeout); one that returns while the interpreter finalizes cannot take the GIL,
    unwinds through C++ and aborts the process -- exit 134 after every test had passed, seen
    once in a clean CI run. ``CHECKFREE_HARD_EXIT=0`` turns this off."""
    if _EXIT_STATUS and os.environ.get("CHECKFREE_HARD_EXIT", "1") != "0":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
