"""Worker deaths the job causes on purpose: an injected kill, the chaos monkey's, the controller's.

Whoever kills a worker notes its pid here first (`expect_exit`), so that the log reports
the death in one line instead of Ray's paragraph about an unexpected one (the filter is
in `recovery.groups.ray_env`). The controller still finds the death as it finds any other.
"""

from __future__ import annotations

__all__ = ["EXPECTED_EXITS", "expect_exit"]

EXPECTED_EXITS: dict[int, str] = {}
"""Worker pid -> why the job itself ends that process (an injected kill, the controller's)."""


def expect_exit(pid: int, why: str) -> None:
    """Note that worker process ``pid`` is about to die on purpose: logs then say so in one
    line instead of reporting an unexpected death (see ``recovery/groups/ray_env.py``)."""
    EXPECTED_EXITS[pid] = why
