"""The run folder's line files (recovery/rundir.py) after a crash: a torn last line of
``metrics.jsonl`` or ``events.jsonl`` (power loss, a full disk: lines are appended without
fsync) is skipped with a warning, and the next line starts clean; a torn line anywhere
else is an error naming the file and the line."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest

from parallelism import Topology
from recovery import Trainer
from recovery.rundir import RunDir
from recovery.runtime.records import StepRecord
from recovery.trainer import _ProgressBar
from tests.workloads import mlp_spec

RECORDS = [
    StepRecord(
        step=s, loss=1.0 / (s + 1), time=float(s), step_s=0.1, tokens_per_s=10.0, generation=0,
        grad_norms=[1.0], bubble=0.0,
    ).to_dict()
    for s in range(3)
]  # fmt: skip
TORN = '{"step": 3, "loss": 0.2'


def _written(tmp_path: Path, name: str = "metrics.jsonl") -> RunDir:
    run = RunDir(tmp_path)
    for record in RECORDS:
        run.append(name, record)
    with run.file(name).open("a") as fh:
        fh.write(TORN)  # the crash: the line never got its end
    return run


@pytest.mark.parametrize("name", ["metrics.jsonl", "events.jsonl"])
def test_a_torn_last_line_is_skipped_with_a_warning(
    tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = _written(tmp_path, name)
    with caplog.at_level(logging.WARNING, logger="recovery.rundir"):
        assert run.read_lines(name) == RECORDS
    assert f"{name}: skipping its torn last line 4" in caplog.text


@pytest.mark.parametrize("name", ["metrics.jsonl", "events.jsonl"])
def test_the_line_after_a_torn_one_starts_clean(tmp_path: Path, name: str) -> None:
    run = _written(tmp_path, name)
    run.append(name, {"step": 3})
    assert run.read_lines(name) == [*RECORDS, {"step": 3}]
    assert len(run.file(name).read_text().splitlines()) == 4  # the torn line is gone


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.file("metrics.jsonl").write_text('{"step": 0}\n{"step": 1}')
    run.append("metrics.jsonl", {"step": 2})
    assert run.read_lines("metrics.jsonl") == [{"step": 0}, {"step": 1}, {"step": 2}]


def test_a_torn_line_before_the_last_is_an_error_naming_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.file("metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        run.read_lines("metrics.jsonl")


def test_a_resume_reads_past_a_torn_metrics_line(tmp_path: Path) -> None:
    """What `Trainer.fit` does once the workers loaded the durable snapshot of step 2: the
    earlier run's records before it are kept, the torn one is not in the way."""
    _written(tmp_path)
    trainer = Trainer(mlp_spec(), topology=Topology(2, 1), run_dir=tmp_path)
    controller = types.SimpleNamespace(
        resumed_from=2,
        records=[],
        events=[],
        generation=0,
        on_event=lambda event: None,
        persistence=types.SimpleNamespace(resharded_from=None),  # the same topology's
    )
    trainer._note_resume(controller, _ProgressBar(4, enabled=False))  # type: ignore[arg-type]
    assert [r.step for r in controller.records] == [0, 1]
    (event,) = controller.events
    assert event.cause == "driver restarted" and event.lost_steps == 1  # it reached step 3
