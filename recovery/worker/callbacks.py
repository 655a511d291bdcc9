"""The user's callbacks as a worker calls them: an exception they raise says where it came from.

`guard_callbacks` wraps every callback of a `TrainSpec` so that an exception it raises
inside a worker becomes a `recovery.errors.CallbackError` naming the callback and its
arguments, the worker and the step, with the user's exception as its cause -- instead of a
raw ``RayTaskError`` wrapper around a traceback through the runtime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from parallelism.spec import TrainSpec
from recovery.errors import CallbackError

_AT_START = ("build_stage", "make_optimizer", "shared_params")
"""Callbacks a worker calls while it is set up (no step yet)."""
_PER_STEP = ("loss_fn", "batches", "val_batches", "lr_schedule")


class _Where(Protocol):
    stage: int
    replica: int
    step: int


@dataclasses.dataclass(frozen=True)
class _Guarded:
    name: str
    fn: Callable[..., Any]
    where: _Where
    at_start: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except CallbackError:
            raise
        except Exception as exc:
            shown = ", ".join(
                [*(_short(a) for a in args), *(f"{k}={_short(v)}" for k, v in kwargs.items())]
            )
            step = None if self.at_start else self.where.step
            raise CallbackError(
                f"{self.name}({shown})", step, self.where.stage, self.where.replica, exc
            ) from exc


def _short(value: Any) -> str:
    """An argument as the message shows it: numbers as they are, tensors by shape."""
    if isinstance(value, int | float | str | bool) or value is None:
        return repr(value)
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"<{type(value).__name__} {tuple(shape)}>"
    return f"<{type(value).__name__}>"


def guard_callbacks(spec: TrainSpec, where: _Where) -> TrainSpec:
    """``spec`` with each callback raising `CallbackError` (see the module docstring)."""
    guarded: dict[str, Any] = {}
    for name in (*_AT_START, *_PER_STEP):
        fn = getattr(spec, name)
        if fn is not None and not isinstance(fn, _Guarded):
            guarded[name] = _Guarded(name, fn, where, name in _AT_START)
    return dataclasses.replace(spec, **guarded)
