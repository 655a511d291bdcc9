"""Test streams under pytest-xdist (``-n 2``, in pyproject's ``addopts``): every test that
uses the session's Ray in one test process, every test that runs a Ray of its own in
another, and the rest wherever a process is free (tests/conftest.py wires it in;
docs/testing.md has the times).

The session's Ray tests share one local Ray per process, and each starts workers that are
processes of their own: they run one after another in one process, which their workers'
processes keep about three quarters busy on 2 cores. The tests with a Ray of their own (a
multi-node `ray.cluster_utils.Cluster`, a `ray start` head, a driver subprocess that starts
one) touch no other Ray, so they run beside those as a second stream; in the same process
they come last, because a cluster takes that process's session Ray down. Every other test
(the thread runtime, pure functions) waits on Gloo and timers about half the time, and
fills in around both.

xdist's own ``--dist loadgroup`` would do this from an ``xdist_group`` mark, but it groups by
suffixing ``item._nodeid``, which pytest 9 no longer reads (nodes are named from ``_id``):
the groups were silently ignored, and two processes each started a Ray. So the workers, which
collect, write the two streams' ids to a file the controller named (`RAY_TESTS_KEY`), and
the controller's scheduler (`RayStream`) reads it once collection is done.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

RAY_TESTS_KEY = "checkfree_ray_tests"
"""The ``workerinput`` key naming the file the workers write the two streams' ids to."""

RAY = "ray"
"""The scope, in `RayStream`, of every test on the session's Ray."""

OWN_RAY = "own-ray"
"""The scope, in `RayStream`, of every test that runs a Ray of its own."""


class RayStream(LoadScopeScheduling):
    """`LoadScopeScheduling` with one scope for the tests on the session's Ray, one for the
    tests with a Ray of their own, each other test a scope of its own. The scopes with the
    most tests go first, one to each process, so both Ray streams start at once, in two
    processes when there are two, and the processes take the rest one test at a time beside
    them; within a stream, the tests keep the collection's order."""

    def __init__(self, config, log, ray_tests: Path) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, log)
        self._file = ray_tests
        self._scopes: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._scopes is None:  # first asked once every worker has collected, so it exists
            streams = json.loads(self._file.read_text())
            self._scopes = {n: scope for scope in (RAY, OWN_RAY) for n in streams[scope]}
        return self._scopes.get(nodeid, nodeid)


def write_ray_tests(path: Path, session: list[str], own: list[str]) -> None:
    """Write the two streams' ids to ``path`` whole (every worker writes the same lists):
    ``session``, the tests on the session's Ray; ``own``, those with a Ray of their own."""
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(json.dumps({RAY: session, OWN_RAY: own}))
    part.replace(path)


def record_ray_test(path: Path, worker: str) -> None:
    """Note that ``worker`` (``gw0``, ...) ran a test on the session's Ray, beside the ids
    file ``path``."""
    with path.with_name("ray-workers").open("a") as f:
        f.write(worker + "\n")


def more_than_one_stream(path: Path) -> str | None:
    """What went wrong if the tests on the session's Ray ran in more than one test process,
    else None: each process would have started a Ray of its own and its workers again, and
    a cluster test in one would take its Ray down."""
    workers = path.with_name("ray-workers")
    seen = sorted(set(workers.read_text().split())) if workers.exists() else []
    if len(seen) <= 1:
        return None
    return (
        f"the session's Ray tests ran in {len(seen)} test processes ({', '.join(seen)}), not one: "
        "tests/streams.py's scheduler was not used or did not group them"
    )
