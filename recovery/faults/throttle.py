"""A straggler made from outside: a process stopped and continued in a duty cycle.

`Throttle` is what a noisy neighbour, a throttled CPU or a slow NIC does to a worker, done
by another process that knows nothing of the job but a pid: every ``period_s`` it sends
SIGSTOP, waits ``(1 - 1/factor) * period_s``, sends SIGCONT and lets it run for the rest
-- so the process gets ``1/factor`` of the wall-clock time and everything it does takes
about ``factor`` times as long (for 3x: stopped 3.3 ms of every 5). It goes on until the
process exits (the job replaced it) or `stop`, and always leaves the process continued.

The period is short on purpose: a straggler shows in its compute time (see [Note:
stragglers] in recovery/runtime/stragglers.py), and a stop stretches a forward or backward
pass only if it lands inside one. With 30 ms periods a worker whose passes take ~0.5 ms
runs each pass whole in its 10 ms of running and is stopped mostly while it waits for its
peers: measured on the 2-core machine (4x2 wide MLP), its compute was 2x its replica's in
6 of 20 steps, against 13 of 20 with 5 ms periods, which stretch the passes as a slow
device would. The chaos tool's throttle mode (``checkfree chaos --throttle 3``), the
straggler benchmark (``checkfree bench stragglers``) and tests/test_stragglers_ray.py use
it; the library's own `Slow` fault is the in-process counterpart.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

from recovery.faults.monkey import process_gone

__all__ = ["Throttle"]


class Throttle:
    """Duty-cycle a process with SIGSTOP/SIGCONT from a thread of this one (see the module
    docstring).

    Args:
        find_pid: the pid to throttle, or None while there is none yet (polled).
        factor: the slowdown; the process is stopped ``1 - 1/factor`` of each period.
        period_s: one stop plus one run.
        when: throttling starts once this returns True (polled every few ms).
        timeout_s: give up waiting for ``when`` and a pid after this long.

    Raises:
        ValueError: for a factor not above 1 or a period not positive.
    """

    def __init__(
        self,
        find_pid: Callable[[], int | None],
        *,
        factor: float = 3.0,
        period_s: float = 0.005,
        when: Callable[[], bool] = lambda: True,
        timeout_s: float = 300.0,
    ) -> None:
        if not factor > 1.0:
            raise ValueError(f"factor must be greater than 1, got {factor!r}")
        if not period_s > 0.0:
            raise ValueError(f"period_s must be positive, got {period_s!r}")
        self.find_pid, self.when, self.timeout_s = find_pid, when, timeout_s
        self.stop_s = period_s * (1.0 - 1.0 / factor)
        self.run_s = period_s - self.stop_s
        self.pid: int | None = None
        self.started_at: float | None = None
        """``time.time()`` of the first SIGSTOP (None: not begun)."""
        self.ended_at: float | None = None
        self.cycles = 0
        self.exited = False
        """The process exited while throttled (rather than `stop`)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="throttle", daemon=True)

    def start(self) -> Throttle:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop throttling (the process is left continued)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def wait(self, timeout_s: float) -> bool:
        """Wait until the throttle ends (the process exited, or `stop`); whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        pid = None
        while not self._stop.is_set() and time.monotonic() < deadline:
            if self.when():
                pid = self.find_pid()
                if pid is not None:
                    break
            time.sleep(0.005)
        if pid is None:
            return
        self.pid, self.started_at = pid, time.time()
        try:
            while not self._stop.is_set():
                if process_gone(pid):
                    raise ProcessLookupError(pid)
                os.kill(pid, signal.SIGSTOP)
                self._stop.wait(self.stop_s)
                os.kill(pid, signal.SIGCONT)
                self.cycles += 1
                self._stop.wait(self.run_s)
        except ProcessLookupError:
            self.exited = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self.ended_at = time.time()
