"""Shared fixtures: one local Ray for the whole session, test workloads shipped by value;
the timeout backstop (tests/backstop.py)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

# Token auth is Ray's default for a new local cluster; a stale ~/.ray/auth_token must not
# decide whether the tests pass, so the tests run their clusters without it.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.pop("RAY_ADDRESS", None)

import pytest
import torch
from ray import cloudpickle

import tests.workloads
from tests.streams import RAY_TESTS_KEY, more_than_one_stream, record_ray_test, write_ray_tests

cloudpickle.register_pickle_by_value(tests.workloads)
torch.set_num_threads(1)


_EXIT_STATUS: list[int] = []


@pytest.fixture
def ray_local():
    """A local Ray on 127.0.0.1, started once and shared by the tests that use it."""
    from recovery.groups.ray_env import connect

    connect()
    yield


@pytest.fixture
def empty_pool():
    """The driver's worker pool empty for the test, so its workers start fresh; the workers
    parked by earlier tests are set aside and put back after, so the tests that follow
    take them instead of starting processes again (about 4 CPU-seconds each)."""
    from recovery.groups.pool import POOL

    POOL._check_session()
    session, aside, POOL._idle = POOL._session, POOL._idle, {}
    yield POOL
    POOL._check_session()
    if POOL._session == session:  # else Ray restarted meanwhile: the set-aside actors are gone
        for key, actors in aside.items():
            POOL._idle.setdefault(key, []).extend(actors)


_CLUSTERS = ("cluster", "full_cluster")
"""Fixtures that connect the test process to a multi-node `ray.cluster_utils.Cluster` of
their own (shutting down the session's Ray if it was connected), torn down after."""

_USE_RAY = ("ray_local", *_CLUSTERS)
"""Fixtures that connect the test process to Ray."""


def _uses_ray(item: pytest.Item) -> bool:
    return item.get_closest_marker("ray") is not None or any(
        name in _USE_RAY for name in getattr(item, "fixturenames", ())
    )


def _own_ray(item: pytest.Item) -> bool:
    """Runs a Ray of its own (a cluster, a `ray start` head, a driver subprocess that starts
    one) and never uses the session's."""
    return item.get_closest_marker("own_ray") is not None or any(
        name in _CLUSTERS for name in getattr(item, "fixturenames", ())
    )


def pytest_configure(config):  # type: ignore[no-untyped-def]
    config.pluginmanager.import_plugin("tests.backstop")


@pytest.hookimpl(tryfirst=True)  # sees every item, before -m/-k deselect some
def pytest_collection_modifyitems(session, config, items):  # type: ignore[no-untyped-def]
    """The Ray tests (marked ``ray`` or using a Ray fixture) first, the ones with a Ray of
    their own last among them: a cluster takes the session's local Ray down, and every Ray
    test after it would start Ray and its workers again (10-20 s on 2 cores). Under xdist
    the two are streams of their own, in this order, each in one process
    (tests/streams.py)."""
    ray_tests = [item for item in items if _uses_ray(item)]
    chosen = set(map(id, ray_tests))
    ray_tests.sort(key=_own_ray)  # stable: otherwise in collection order
    items[:] = ray_tests + [item for item in items if id(item) not in chosen]
    path = getattr(config, "workerinput", {}).get(RAY_TESTS_KEY)
    if path is not None:
        write_ray_tests(
            Path(path),
            session=[item.nodeid for item in ray_tests if not _own_ray(item)],
            own=[item.nodeid for item in ray_tests if _own_ray(item)],
        )


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # type: ignore[no-untyped-def]
    """xdist's controller, before each worker starts: where to write the Ray tests' ids."""
    node.workerinput[RAY_TESTS_KEY] = str(_ray_tests_file(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """The two Ray streams in a process each, the others spread over all (tests/streams.py)."""
    from tests.streams import RayStream

    return RayStream(config, log, _ray_tests_file(config))


def _ray_tests_file(config: pytest.Config) -> Path:
    if _RAY_TESTS not in config.stash:
        config.stash[_RAY_TESTS] = Path(tempfile.mkdtemp(prefix="checkfree-streams-")) / "ray"
    return config.stash[_RAY_TESTS]


_RAY_TESTS = pytest.StashKey[Path]()


def pytest_runtest_setup(item):  # type: ignore[no-untyped-def]
    workerinput = getattr(item.config, "workerinput", {})
    if RAY_TESTS_KEY in workerinput and _uses_ray(item) and not _own_ray(item):
        record_ray_test(Path(workerinput[RAY_TESTS_KEY]), workerinput["workerid"])


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    if _RAY_TESTS in session.config.stash:  # xdist's controller: were they one stream?
        wrong = more_than_one_stream(session.config.stash[_RAY_TESTS])
        if wrong is not None:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            reporter.ensure_newline()
            reporter.write_line(f"ERROR: {wrong}", red=True)
            session.exitstatus = exitstatus = pytest.ExitCode.TESTS_FAILED
        shutil.rmtree(session.config.stash[_RAY_TESTS].parent, ignore_errors=True)
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
