"""Two test streams under pytest-xdist (``-n 2``, in pyproject's ``addopts``): every Ray test in
one test process, the rest in the others (tests/conftest.py wires it in; docs/testing.md has
the times).

The Ray tests share one local Ray per process, some take it down for a cluster of their own
or `ray stop` every Ray on the machine, and each starts workers that are processes of their
own: they run one after another in one process, which their workers' processes keep about
three quarters busy on 2 cores. Every other test (the thread runtime, pure functions) waits on
Gloo and timers about half the time, so it runs beside them in another process.

xdist's own ``--dist loadgroup`` would do this from an ``xdist_group`` mark, but it groups by
suffixing ``item._nodeid``, which pytest 9 no longer reads (nodes are named from ``_id``):
the groups were silently ignored, and two processes each started a Ray. So the workers, which
collect, write the Ray tests' ids to a file the controller named (`RAY_TESTS_KEY`), and the
controller's scheduler (`RayStream`) reads it once collection is done.
"""

from __future__ import annotations

import os
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

RAY_TESTS_KEY = "checkfree_ray_tests"
"""The ``workerinput`` key naming the file the workers write the Ray tests' ids to."""

RAY = "ray"
"""The scope, in `RayStream`, of every Ray test."""


class RayStream(LoadScopeScheduling):
    """`LoadScopeScheduling` with one scope for every Ray test, each other test a scope of its
    own. The scopes with the most tests go first, so the Ray stream starts at once and the
    other processes take the rest one test at a time beside it; within it, the tests keep the
    collection's order (tests/conftest.py puts the ones that take Ray down last)."""

    def __init__(self, config, log, ray_tests: Path) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, log)
        self._file = ray_tests
        self._ray: frozenset[str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._ray is None:  # first asked once every worker has collected, so it exists
            self._ray = frozenset(self._file.read_text().splitlines())
        return RAY if nodeid in self._ray else nodeid


def write_ray_tests(path: Path, nodeids: list[str]) -> None:
    """Write ``nodeids`` to ``path`` whole (every worker writes the same list)."""
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text("\n".join(nodeids) + "\n")
    part.replace(path)


def record_ray_test(path: Path, worker: str) -> None:
    """Note that ``worker`` (``gw0``, ...) ran a Ray test, beside the ids file ``path``."""
    with path.with_name("ray-workers").open("a") as f:
        f.write(worker + "\n")


def more_than_one_stream(path: Path) -> str | None:
    """What went wrong if the Ray tests ran in more than one test process, else None: each
    process would have started a Ray of its own, and one's `ray stop` ended the other's."""
    workers = path.with_name("ray-workers")
    seen = sorted(set(workers.read_text().split())) if workers.exists() else []
    if len(seen) <= 1:
        return None
    return (
        f"the Ray tests ran in {len(seen)} test processes ({', '.join(seen)}), not one: "
        "tests/streams.py's scheduler was not used or did not group them"
    )
