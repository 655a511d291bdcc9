"""`TensorBoardLogger`: a job's metrics and recoveries as TensorBoard event files, written
through ``torch.utils.tensorboard`` (the ``tensorboard`` package: ``pip install
'checkfree[tensorboard]'``), which is imported only when the first event is written.

What it writes, against the step number of ``metrics.jsonl`` (from 0)::

    train/loss            every committed step
    val/loss              at each evaluation (measured after that step's update)
    perf/step_s           seconds the step took
    perf/tokens_per_s     tokens (samples) per second
    perf/bubble           the pipeline's idle fraction
    grad_norm/stage_<s>   each stage's gradient norm (after clipping)
    recoveries/seconds    each recovery's seconds, at the step it struck
    recoveries (text)     what happened: cause, lost workers, strategy, phases, the plan

[Note: steps redone in TensorBoard]
A rollback redoes steps, and so does a resumed run (a new driver on the same run folder)
from its durable snapshot on: their points come again, with the same step numbers.
TensorBoard's default loader (``tensorboard --logdir``) keeps one point per step in each
series: a point at or below a series' last step drops that series' points from its step
on. The classic loader (``--load_fast=false``, and `EventAccumulator`) keeps them all,
unless the file says the run restarted: a ``SessionLog.START`` at a step drops every
scalar from that step on. So the logger writes that marker whenever a step comes at or
below the last one it wrote (and at its first step, which is what continues a resumed
run's curves), then writes again the recovery seconds it had written from that step on;
a resumed driver's events, which come before its first step, wait for the marker. Both
loaders then show the final trajectory, one point per step. What they still drop: a
recovery at a step below an earlier one's (a failure while a rollback redoes steps) hides
the earlier one's points in the default loader; the classic one drops the seconds (not
the text) of an earlier driver's recoveries from the resume step on. ``events.jsonl`` and
``metrics.jsonl`` keep everything, redone steps included.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recovery.callbacks.callback import Callback
from recovery.events import PHASES

if TYPE_CHECKING:
    from recovery.events import RecoveryEvent
    from recovery.runtime import FitResult, StepRecord

__all__ = ["TensorBoardLogger", "require_tensorboard", "tensorboard_installed"]

_DETAIL_CHARS = 4000
"""The most of an event's detail (errors, plan) a text entry quotes."""


def tensorboard_installed() -> bool:
    """Whether the ``tensorboard`` package can be imported (without importing it)."""
    return importlib.util.find_spec("tensorboard") is not None


def require_tensorboard() -> None:
    """Check that the ``tensorboard`` package is there, before a job needs it.

    Raises:
        ImportError: if it is not installed, saying how to install it.
    """
    if not tensorboard_installed():
        raise ImportError(
            "TensorBoard output needs the tensorboard package: pip install "
            "'checkfree[tensorboard]' (or pip install tensorboard)"
        )


class TensorBoardLogger(Callback):
    """Writes a job's metrics and recoveries as TensorBoard event files in ``log_dir``
    (see the module docstring for the series). `Trainer` adds one writing into
    ``<run_dir>/tensorboard`` by itself (``Trainer(tensorboard=...)``); pass your own in
    ``callbacks`` to write elsewhere.

    Each step and recovery reaches the file as it is written (like ``metrics.jsonl``; a
    flush costs no more than the points), so TensorBoard shows a run live, and a driver
    killed half-way leaves its curves for the one that resumes it.

    Args:
        log_dir: the folder for the event files (created when the first is written).

    Raises:
        ImportError: if the tensorboard package is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        require_tensorboard()
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._last_step: int | None = None
        """The highest step written since the last restart marker (None: none yet)."""
        self._held: list[RecoveryEvent] = []
        """Events that came before the first step (a resumed driver's): they wait for the
        first restart marker."""
        self._texts: dict[int, list[str]] = {}
        """The text entries written, by step: recoveries at one step share one entry."""
        self._seconds: list[tuple[int, float]] = []
        """The recovery seconds written, (step, seconds), in order."""

    # -- the hooks -----------------------------------------------------------------------

    def on_step(self, record: StepRecord) -> None:
        writer = self._open()
        step = record.step
        if self._last_step is None or step <= self._last_step:
            self._restart(step)
        self._last_step = step
        writer.add_scalar("train/loss", record.loss, step)
        if record.val_loss is not None:
            writer.add_scalar("val/loss", record.val_loss, step)
        writer.add_scalar("perf/step_s", record.step_s, step)
        writer.add_scalar("perf/tokens_per_s", record.tokens_per_s, step)
        writer.add_scalar("perf/bubble", record.bubble, step)
        for stage, norm in enumerate(record.grad_norms):
            writer.add_scalar(f"grad_norm/stage_{stage}", norm, step)
        writer.flush()

    def on_event(self, event: RecoveryEvent) -> None:
        if self._last_step is None:  # before this driver's first step: after its marker
            self._held.append(event)
            return
        self._write_event(event)
        self._open().flush()

    def on_fit_end(self, result: FitResult) -> None:
        self.close()

    def on_fit_error(self, error: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Write what is held, flush and close the file (a later point opens a new one)."""
        if self._held:
            for event in self._held:
                self._write_event(event)
            self._held = []
        if self._writer is not None:
            self._writer.close()
        self._writer, self._last_step = None, None
        self._texts, self._seconds = {}, []

    # -- writing -------------------------------------------------------------------------

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir))
        return self._writer

    def _restart(self, step: int) -> None:
        """Write a restart marker at ``step``: see [Note: steps redone in TensorBoard]."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        writer = self._open()
        writer.file_writer.add_event(
            Event(step=step, session_log=SessionLog(status=SessionLog.START))
        )
        for at, seconds in self._seconds:
            if at >= step:
                writer.add_scalar("recoveries/seconds", seconds, at)
        held, self._held = self._held, []
        for event in held:
            self._write_event(event)

    def _write_event(self, event: RecoveryEvent) -> None:
        writer = self._open()
        self._seconds.append((event.step, event.seconds))
        writer.add_scalar("recoveries/seconds", event.seconds, event.step)
        entries = self._texts.setdefault(event.step, [])
        entries.append(describe(event))
        writer.add_text("recoveries", "\n\n---\n\n".join(entries), event.step)


def describe(event: RecoveryEvent) -> str:
    """A recovery as a Markdown paragraph (TensorBoard's text tab renders Markdown)."""
    lost = ", ".join(f"({s},{r})" for s, r in event.lost) or "none"
    phases = ", ".join(
        f"{phase} {event.breakdown[phase]:.2f} s" for phase in PHASES if phase in event.breakdown
    )
    lines = [
        f"**{event.cause}** at step {event.step}: lost worker(s) (stage, replica) {lost}; "
        f"recovered by **{event.strategy}** in {event.seconds:.2f} s"
        + (f" ({phases})" if phases else ""),
        "",
        f"generation {event.generation}; {event.bytes_moved / 1e6:.1f} MB moved; "
        f"{event.lost_steps} step(s) redone"
        + (f"; restored from the {event.tier} tier" if event.tier else "")
        + (f"; interrupted {len(event.interruptions)} time(s)" if event.interruptions else ""),
    ]
    if event.detail:
        detail = event.detail[:_DETAIL_CHARS]
        lines += ["", *("    " + line for line in detail.splitlines())]
    return "\n".join(lines)
