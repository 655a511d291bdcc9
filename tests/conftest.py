"""Shared fixtures: one local Ray for the whole session, test workloads shipped by value."""

from __future__ import annotations

import os

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


@pytest.fixture
def ray_local():
    """A local Ray on 127.0.0.1, started once and shared by the tests that use it."""
    from recovery.ray_env import connect

    connect()
    yield


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    import ray

    if ray.is_initialized():
        from recovery.pool import POOL

        POOL.clear()
        ray.shutdown()
