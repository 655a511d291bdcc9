"""A backstop behind pytest-timeout, so that no test can hang the run.

pytest-timeout's ``signal`` method (this suite's) fails a test that runs past its timeout
by raising in the main thread, and the run goes on. It cannot end a test whose main thread
never comes back to Python to take that exception -- one blocked inside C++, or a process
where some thread blocks while holding the GIL, so that no Python code runs at all (its
``thread`` method, a Python timer, cannot run then either). One such test held a CI run
until the CI's own limit, 90 minutes, with nothing printed. The backstop is faulthandler's
watchdog, a C thread that needs no GIL: ``BACKSTOP_S`` after a test's timeout it writes
every thread's Python stack to the real stderr and exits 1.

``CHECKFREE_TIMEOUT_BACKSTOP_S`` sets the grace (seconds; default 60).
"""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest

BACKSTOP_S = float(os.environ.get("CHECKFREE_TIMEOUT_BACKSTOP_S", "60"))
_STDERR = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # pytest captures fd 2 during a test, and a capture is lost at os._exit: write to a
    # copy of the real one (taken here, where pytest's own faulthandler takes its copy).
    config.stash[_STDERR] = os.dup(sys.__stderr__.fileno() if sys.__stderr__ else 2)


def pytest_unconfigure(config: pytest.Config) -> None:
    faulthandler.cancel_dump_traceback_later()
    if _STDERR in config.stash:
        os.close(config.stash[_STDERR])
        del config.stash[_STDERR]


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):  # type: ignore[no-untyped-def]
    """Arm the backstop; return None, so that pytest-timeout arms its own timer too."""
    if settings.timeout and settings.timeout > 0 and _STDERR in item.config.stash:
        out = item.config.stash[_STDERR]
        os.write(out, b"")  # (fails here, not in the watchdog, if the copy is gone)
        faulthandler.dump_traceback_later(settings.timeout + BACKSTOP_S, exit=True, file=out)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):  # type: ignore[no-untyped-def]
    faulthandler.cancel_dump_traceback_later()
