"""Metrics where users look: the callbacks the driver calls as a job trains, and the
TensorBoard event files of its run folder, read back with TensorBoard's own reader.

The callback and TensorBoard pieces are tested alone first (made-up steps and events, no
job: a rollback, a resumed driver); then one real job on Ray -- a worker killed, so there
is a recovery -- runs them all at once and every test of the last part reads what it left.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from parallelism import Topology
from recovery import Callback, FitResult, Kill, RecoveryEvent, TensorBoardLogger, Trainer
from recovery.callbacks import CallbackList
from recovery.faults import FailureSchedule
from recovery.runtime import StepRecord
from tests.workloads import mlp_spec, regression_batches

tensorboard = pytest.importorskip("tensorboard", reason="needs the tensorboard extra")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

STEPS = 8
KILLED_AT = 4
ROOT = Path(__file__).resolve().parents[1]


class Counting(Callback):
    """Keeps what every hook received."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.events: list[RecoveryEvent] = []
        self.ends: list[FitResult] = []
        self.errors: list[BaseException] = []

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def on_event(self, event: RecoveryEvent) -> None:
        self.events.append(event)

    def on_fit_end(self, result: FitResult) -> None:
        self.ends.append(result)

    def on_fit_error(self, error: BaseException) -> None:
        self.errors.append(error)


class OnlySteps:
    """A callback that is not a `Callback` and has one hook: that is enough."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record.step)


class Broken(Callback):
    """A user's bug in two hooks."""

    def on_step(self, record: StepRecord) -> None:
        raise ZeroDivisionError(f"no rate at step {record.step}")

    def on_event(self, event: RecoveryEvent) -> None:
        raise KeyError("strategy")


def record(step: int, loss: float, val_loss: float | None = None) -> StepRecord:
    return StepRecord(
        step=step,
        loss=loss,
        time=0.1 * step,
        step_s=0.1,
        tokens_per_s=640.0,
        generation=0,
        grad_norms=[1.0, 2.0],
        bubble=0.25,
        val_loss=val_loss,
    )


def event(
    step: int, seconds: float, *, lost_steps: int = 0, cause: str = "killed"
) -> RecoveryEvent:
    return RecoveryEvent(
        step=step,
        generation=1,
        cause=cause,
        lost=[(0, 1)],
        strategy="rollback" if lost_steps else "replica_copy",
        seconds=seconds,
        lost_steps=lost_steps,
    )


class Records(logging.Handler):
    """The log records of the ``checkfree`` logger, debug level included, while open."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        logger = logging.getLogger("checkfree")
        self._level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("checkfree")
        logger.removeHandler(self)
        logger.setLevel(self._level)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


def read(log_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return accumulator


def scalars(accumulator: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


def texts(
    accumulator: EventAccumulator, tag: str = "recoveries/text_summary"
) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in accumulator.Tensors(tag)]


# -- the callbacks, alone ------------------------------------------------------------------


def test_a_raising_callback_is_reported_once_per_hook_and_the_others_still_run() -> None:
    counting, only_steps = Counting(), OnlySteps()
    callbacks = CallbackList([Broken(), counting, only_steps])
    with Records() as logs:
        for step in range(5):
            callbacks.on_step(record(step, 1.0))
        callbacks.on_event(event(2, 0.5))
        callbacks.on_fit_error(RuntimeError("the job failed"))
    assert [r.step for r in counting.steps] == only_steps.steps == [0, 1, 2, 3, 4]
    assert len(counting.events) == len(counting.errors) == 1
    warnings = logs.messages(logging.WARNING)
    assert len(warnings) == 2, warnings  # once per callback and hook, not once per call
    assert "Broken.on_step raised ZeroDivisionError: no rate at step 0" in warnings[0]
    assert "Broken.on_event raised KeyError" in warnings[1]
    tracebacks = [r for r in logs.records if r.levelno == logging.DEBUG and r.exc_info]
    assert len(tracebacks) == 6  # every error, with its traceback
    assert callbacks.errors == {(0, "on_step"): 5, (0, "on_event"): 1}


def test_an_interrupt_in_a_callback_is_not_swallowed() -> None:
    class Interrupted(Callback):
        def on_step(self, record: StepRecord) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        CallbackList([Interrupted()]).on_step(record(0, 1.0))


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        ([Counting(), print], r"callbacks\[1\] \(builtin_function_or_method\) has none of"),
        (Counting(), r"callbacks must be a list of callbacks, got Counting"),
    ],
)
def test_a_callback_without_hooks_is_refused_before_anything_starts(
    callbacks: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Trainer(mlp_spec(), topology=Topology(2, 1), callbacks=callbacks)


def test_tensorboard_true_needs_a_run_folder() -> None:
    with pytest.raises(ValueError, match="tensorboard=True writes into the run folder"):
        Trainer(mlp_spec(), topology=Topology(2, 1), tensorboard=True)
    for wrong in ("yes", 1):
        with pytest.raises(
            ValueError, match=f"tensorboard must be None, True or False, got {wrong!r}"
        ):
            Trainer(mlp_spec(), topology=Topology(2, 1), tensorboard=wrong)  # type: ignore[arg-type]


# -- TensorBoard, alone ------------------------------------------------------------------


def test_tensorboard_is_imported_only_to_write() -> None:
    """A job, its run folder and its logger set up: tensorboard is still not imported."""
    code = (
        "import sys, tempfile\n"
        "from parallelism import Topology\n"
        "from recovery import Trainer, TensorBoardLogger\n"
        "from tests.workloads import mlp_spec\n"
        "trainer = Trainer(mlp_spec(), topology=Topology(2, 1), run_dir=tempfile.mkdtemp())\n"
        "logger = trainer._job_callbacks().callbacks[0]\n"
        "assert isinstance(logger, TensorBoardLogger), logger\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'tensorboard')\n"
        "assert loaded == [], loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_a_rollback_and_a_resumed_driver_leave_one_loss_point_per_step(tmp_path: Path) -> None:
    """As a job calls it: steps 0-4, a replica copy at step 4 (its event after the step
    committed after it); a rollback from step 9 to step 6 (the redone step 6 commits, then
    its event comes); steps to 10, then the driver dies. A new driver resumes from the
    snapshot of step 8 (its event first), and trains to step 13. TensorBoard shows the
    final trajectory, one point per step, and every recovery."""
    first = TensorBoardLogger(tmp_path)
    for step in range(5):
        first.on_step(record(step, float(step)))
    first.on_event(event(4, 1.5))
    for step in range(5, 9):
        first.on_step(record(step, float(step)))
    first.on_step(record(6, 100.0 + 6))
    first.on_event(event(9, 2.5, lost_steps=3))
    for step in range(7, 11):
        first.on_step(record(step, 100.0 + step, val_loss=0.5 if step == 10 else None))
    first.on_fit_error(RuntimeError("the driver died"))

    second = TensorBoardLogger(tmp_path)
    second.on_event(event(11, 0.0, lost_steps=3, cause="driver restarted"))
    for step in range(8, 14):
        second.on_step(record(step, 1000.0 + step))
    second.on_fit_end(None)  # type: ignore[arg-type]

    board = read(tmp_path)
    expected = [float(s) for s in range(6)] + [106.0, 107.0] + [1000.0 + s for s in range(8, 14)]
    assert scalars(board, "train/loss") == list(enumerate(expected))
    assert [s for s, _ in scalars(board, "grad_norm/stage_1")] == list(range(14))
    assert scalars(board, "val/loss") == []  # measured on a trajectory that was redone
    # The classic reader drops the first driver's scalars from the resume step (8) on: its
    # rollback's seconds (step 9) are gone there, its text stays (see the module's Note).
    assert scalars(board, "recoveries/seconds") == [(4, 1.5), (11, 0.0)]
    entries = texts(board)
    assert [s for s, _ in entries] == [4, 9, 11]
    assert "**killed** at step 4" in entries[0][1] and "**replica_copy** in 1.50 s" in entries[0][1]
    assert "**rollback** in 2.50 s" in entries[1][1] and "3 step(s) redone" in entries[1][1]
    assert "**driver restarted** at step 11" in entries[2][1]


def test_two_recoveries_at_one_step_share_its_text_entry(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.on_step(record(0, 1.0))
    logger.on_event(event(1, 0.5))
    logger.on_event(event(1, 0.7))  # the redone step failed again
    logger.on_fit_end(None)  # type: ignore[arg-type]
    (*_, (step, text)) = texts(read(tmp_path))
    assert step == 1 and "in 0.50 s" in text and "in 0.70 s" in text


# -- one job on Ray ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A job of 2 stages x 2 replicas with a worker killed at step 4, evaluating every 2
    steps, its callbacks a broken one between two that count."""
    from recovery.groups.ray_env import connect

    connect()
    run_dir = tmp_path_factory.mktemp("run")
    counting, broken, only_steps = Counting(), Broken(), OnlySteps()
    trainer = Trainer(
        mlp_spec(val_batches=regression_batches),
        topology=Topology(2, 2),
        failures=FailureSchedule([Kill(step=KILLED_AT, stage=0, replica=1)]),
        run_dir=run_dir,
        eval_every=2,
        collect_states=False,
        callbacks=[counting, broken, only_steps],
    )
    with Records() as logs:
        result = trainer.fit(STEPS)
    yield {
        "result": result,
        "run_dir": run_dir,
        "counting": counting,
        "only_steps": only_steps,
        "logs": logs,
    }


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_the_callbacks_see_every_step_and_recovery_and_the_end(job: dict[str, Any]) -> None:
    result, counting = job["result"], job["counting"]
    (recovery,) = result.events  # the kill fired and was recovered
    assert recovery.cause == "killed" and recovery.lost == [(0, 1)]
    assert len(counting.steps) == len(result.metrics) == STEPS
    assert [r.to_dict() for r in counting.steps] == result.metrics
    assert counting.events == result.events
    assert counting.ends == [result] and counting.errors == []
    assert job["only_steps"].steps == list(range(STEPS))  # after the broken one, every step
    warnings = job["logs"].messages(logging.WARNING)
    assert [w for w in warnings if "Broken.on_step raised ZeroDivisionError" in w] != []
    assert [w for w in warnings if "Broken.on_event raised KeyError" in w] != []
    assert len([w for w in warnings if "Broken" in w]) == 2


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_the_run_folder_has_tensorboard_files_with_every_step_and_the_recovery(
    job: dict[str, Any],
) -> None:
    result = job["result"]
    board = read(job["run_dir"] / "tensorboard")
    # One point per step, the loss of metrics.jsonl (TensorBoard keeps float32).
    loss = scalars(board, "train/loss")
    assert [s for s, _ in loss] == list(range(STEPS))
    assert [v for _, v in loss] == pytest.approx(result.losses, rel=1e-6)
    val = scalars(board, "val/loss")
    assert [s + 1 for s, _ in val] == [s for s, _ in result.val_losses] == [2, 4, 6, 8]
    assert [v for _, v in val] == pytest.approx([v for _, v in result.val_losses], rel=1e-6)
    for tag in ("perf/step_s", "perf/tokens_per_s", "grad_norm/stage_0", "grad_norm/stage_1"):
        assert [s for s, _ in scalars(board, tag)] == list(range(STEPS)), tag
    (recovery,) = result.events
    assert scalars(board, "recoveries/seconds") == [(KILLED_AT, pytest.approx(recovery.seconds))]
    ((step, text),) = texts(board)
    assert step == KILLED_AT
    assert f"**killed** at step {KILLED_AT}: lost worker(s) (stage, replica) (0,1)" in text
    assert f"**{recovery.strategy}** in {recovery.seconds:.2f} s" in text
