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
