"""`TrackedEngine`: a `StageEngine` whose progress is what a `Progress` says it is.

`StageEngine` marks its progress by setting ``progressed_at`` at every schedule action
(and around the all-reduce). Here each of those assignments is a mark of a `Progress`
(parallelism/progress.py), and reading ``progressed_at`` asks it -- on a GPU, when the
CUDA work up to the last completed mark finished, not when the CPU queued it. A subclass
rather than a change to the engine, so the engine's loop stays as it is; it can take a
``progress`` of its own instead, and this module go.
"""

from __future__ import annotations

from typing import Any

from parallelism.engine import StageEngine
from parallelism.progress import Progress, progress_for

__all__ = ["TrackedEngine"]


class TrackedEngine(StageEngine):
    """A `StageEngine` (same arguments) whose progress a `Progress` measures.

    Args:
        progress: the measure; default `progress_for` the engine's device.
    """

    def __init__(self, *args: Any, progress: Progress | None = None, **kwargs: Any) -> None:
        self.progress = progress if progress is not None else progress_for(kwargs["device"])
        super().__init__(*args, **kwargs)

    @property
    def progressed_at(self) -> float:
        """When this stage last made progress, on the monotonic clock (see the module)."""
        return self.progress.at()

    @progressed_at.setter
    def progressed_at(self, _now: float) -> None:
        # The engine sets the time it finished an action: that is a mark, dated by the
        # progress (on a GPU, when the action's CUDA work completes).
        self.progress.mark()
