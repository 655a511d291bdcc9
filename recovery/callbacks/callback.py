"""`Callback`: user code the driver calls at every committed step, every recovery and the
end of a fit -- the way to send a job's metrics where its users look (W&B, MLflow, a
dashboard) -- and `CallbackList`, which calls a job's callbacks in order and keeps one that
raises from stopping training.

[Note: a callback never stops training]
A callback is bookkeeping: losing a few points of a dashboard is better than losing the
job (or, worse, a recovery half-way). So `CallbackList` catches what a hook raises
(``Exception``; ``KeyboardInterrupt`` and ``SystemExit`` go through), logs a warning that
names the callback's class and the hook -- once per callback and hook, so a hook that fails
at every step does not flood the log -- and the traceback at debug level every time, and
calls the next callback. The job goes on as if the hook had returned.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recovery.events import RecoveryEvent
    from recovery.runtime import FitResult, StepRecord

__all__ = ["HOOKS", "Callback", "CallbackList"]

log = logging.getLogger("checkfree")

HOOKS = ("on_step", "on_event", "on_fit_end", "on_fit_error")
"""The methods a callback may have; it needs at least one."""


class Callback:
    """Hooks the driver calls while `Trainer.fit` runs: subclass it and override the ones
    you need (the others do nothing). Any object with some of these methods works as a
    callback, too; subclassing tells a type checker what the hooks receive.

    The hooks run on the driver, in the training loop: training waits while a hook runs,
    so a slow one (a network upload) should hand its work to a thread of its own. A hook
    that raises does not stop training: see [Note: a callback never stops training].
    """

    def on_step(self, record: StepRecord) -> None:
        """A committed step: ``record.step`` (from 0), ``loss``, ``step_s``,
        ``tokens_per_s``, ``grad_norms`` (one per stage), ``val_loss`` (when evaluated, else
        None), ``time`` (seconds since training started), ``generation``, ``bubble``.
        A step redone after a rollback comes again, with the same ``step``."""

    def on_event(self, event: RecoveryEvent) -> None:
        """A failure and its recovery (``cause``, ``lost`` workers, ``strategy``,
        ``seconds``, ``lost_steps``...), once the job trains again: after the first step
        committed after it (or at the end, if no step followed). A resumed run (a new
        driver) starts with a ``driver restarted`` event."""

    def on_fit_end(self, result: FitResult) -> None:
        """The fit finished: called once, with what `Trainer.fit` returns, after the run
        folder's summary and plot are written."""

    def on_fit_error(self, error: BaseException) -> None:
        """The fit raised ``error`` (a `RecoveryError`, an interrupt...): called once,
        instead of `on_fit_end`, before the error reaches the caller -- to close what the
        callback opened."""


class CallbackList:
    """A job's callbacks, called in order at each hook; one that raises is reported and
    skipped (see [Note: a callback never stops training]).

    Raises:
        ValueError: if ``callbacks`` is not a list or tuple, or one of them has none of the
            `HOOKS` (a function passed by mistake, say), naming it.
    """

    def __init__(self, callbacks: Sequence[object] = ()) -> None:
        if not isinstance(callbacks, list | tuple):
            raise ValueError(
                f"callbacks must be a list of callbacks, got {type(callbacks).__name__}"
            )
        for i, callback in enumerate(callbacks):
            if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise ValueError(
                    f"callbacks[{i}] ({_name(callback)}) has none of the methods "
                    f"{', '.join(HOOKS)}: pass an object with some of them, e.g. a subclass "
                    "of recovery.Callback"
                )
        self.callbacks: list[object] = list(callbacks)
        self.errors: collections.Counter[tuple[int, str]] = collections.Counter()
        """How many times each hook raised, by (the callback's index, hook)."""

    def __iter__(self) -> Iterator[object]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def on_step(self, record: StepRecord) -> None:
        self._call("on_step", record)

    def on_event(self, event: RecoveryEvent) -> None:
        self._call("on_event", event)

    def on_fit_end(self, result: FitResult) -> None:
        self._call("on_fit_end", result)

    def on_fit_error(self, error: BaseException) -> None:
        self._call("on_fit_error", error)

    def _call(self, hook: str, arg: object) -> None:
        for i, callback in enumerate(self.callbacks):
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(arg)
            except Exception as exc:
                self._report(i, callback, hook, exc)

    def _report(self, index: int, callback: object, hook: str, exc: Exception) -> None:
        self.errors[(index, hook)] += 1
        where = f"{_name(callback)}.{hook}"
        if self.errors[(index, hook)] == 1:
            log.warning(
                "callback %s raised %s: %s -- training goes on; later errors of %s are "
                "logged at debug level only",
                where,
                type(exc).__name__,
                exc,
                where,
            )
        log.debug(
            "callback %s raised (%d times so far)",
            where,
            self.errors[(index, hook)],
            exc_info=exc,
        )


def _name(callback: object) -> str:
    return type(callback).__qualname__
