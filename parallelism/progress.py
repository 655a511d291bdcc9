"""What a worker's progress means, the same on every device: its work has completed.

Hang detection (``recovery/runtime/detection.py``) asks each silent worker how long ago
it last made progress and what it waits for. On the CPU a schedule action is done when
the call that ran it returns. On a GPU it is not: kernels and NCCL operations are only
queued, ``work.wait()`` returns at once, and the CPU really blocks later (in ``.item()``,
``.tolist()``) -- so "the call returned" would say a stalled worker progresses, and
"waiting on a peer" would be false while its GPU waits for that peer.

`Progress` is the CPU's answer (a mark is progress when it is made). `EventProgress`
records an event on the current stream at each mark and counts the mark as progress only
once a poll (``event.query()``, which never blocks) finds it completed; a wait queued on
the device for a peer is recorded the same way, and `waiting_on` names the peer of the
oldest such wait not yet completed. The event factory is injected, so the logic is tested
on the CPU with fake events; `progress_for` picks the right one for a device.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["Event", "EventProgress", "Progress", "progress_for"]


class Event(Protocol):
    """What `EventProgress` needs of an event (``torch.cuda.Event`` has it)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...


class Progress:
    """Progress on the CPU: work is done when the call that ran it returns.

    Args:
        clock: seconds on a monotonic clock (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at = clock()

    def mark(self) -> None:
        """The work issued so far is one more step of progress (a schedule action ended)."""
        self._at = self._clock()

    def queued_wait(self, peer: int) -> None:
        """A wait for ``peer`` (-1: a collective) was queued on the device; the CPU does
        not block on it. Nothing to do on the CPU, where waits block."""

    def at(self) -> float:
        """When this worker last made progress, on the clock."""
        return self._at

    def waiting_on(self) -> int | None:
        """The peer a wait queued on the device has not yet got past, if any."""
        return None


class EventProgress(Progress):
    """Progress on a device that queues work: a mark counts once its event has completed.

    A completed event is dated when a poll first sees it (polls run at every mark and
    every question), which errs towards "progressing": a stuck worker is found at most one
    probe interval late, a healthy one is never called hung early.

    Args:
        make_event: a new event, not yet recorded (``torch.cuda.Event``).
        clock: seconds on a monotonic clock.
    """

    def __init__(
        self, make_event: Callable[[], Event], clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(clock)
        self._make_event = make_event
        self._pending: deque[tuple[Event, int | None]] = deque()
        self._lock = threading.Lock()  # marks come from the step, questions from a probe

    def _record(self, peer: int | None) -> None:
        event = self._make_event()
        event.record()
        with self._lock:
            self._pending.append((event, peer))
            self._poll()

    def mark(self) -> None:
        self._record(None)

    def queued_wait(self, peer: int) -> None:
        self._record(peer)

    def _poll(self) -> None:
        """Drop the completed events, oldest first (a stream completes them in order)."""
        done = False
        while self._pending and self._pending[0][0].query():
            self._pending.popleft()
            done = True
        if done:
            self._at = self._clock()

    def at(self) -> float:
        with self._lock:
            self._poll()
            return self._at

    def waiting_on(self) -> int | None:
        with self._lock:
            self._poll()
            return next((peer for _, peer in self._pending if peer is not None), None)


def progress_for(device: torch.device) -> Progress:
    """`EventProgress` on a CUDA device, `Progress` elsewhere."""
    if device.type == "cuda":
        return EventProgress(torch.cuda.Event)
    return Progress()
