"""A communication error while every worker is alive: retried a bounded number of times,
with a growing wait, then a `RecoveryError` naming the worker and the error (see [Note:
communication errors with nobody lost] in recovery/runtime/controller.py).

The error is planted by wrapping `StageWorker.run_step` on one rank, over threads (no Ray):
the worker raises what a real Gloo reset raises through `StageComm` (a `CommError` whose
cause is Gloo's ``RuntimeError``), before touching its state, so a retry can be exact.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from parallelism import Topology
from parallelism.errors import talks
from recovery import RecoveryError, RecoveryPolicy
from recovery.runtime import Phase, decisions
from recovery.worker import StageWorker
from tests.jobs import drive, make
from tests.workloads import mlp_spec

TOP = Topology(2, 2)
FLAKY = TOP.rank(1, 0)
AT_STEP = 2


@talks  # as every StageComm call that talks to peers is
def _gloo_reset() -> None:
    raise RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer"
    )


def plant_resets(monkeypatch: pytest.MonkeyPatch, times: int | None) -> list[float]:
    """Rank FLAKY raises a connection reset at step AT_STEP, ``times`` times (None: always);
    returns the wall times at which it raised."""
    real = StageWorker.run_step
    raised: list[float] = []

    def run_step(self: StageWorker, step: int, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.rank == FLAKY and step == AT_STEP and (times is None or len(raised) < times):
            raised.append(time.monotonic())
            _gloo_reset()
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(StageWorker, "run_step", run_step)
    return raised


def test_a_persistent_comm_error_gives_up_naming_the_worker_and_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decisions, "COMM_BACKOFF_S", 0.05)
    raised = plant_resets(monkeypatch, times=None)
    controller, _ = make(mlp_spec(), TOP, policy=RecoveryPolicy(comm_retries=2))
    drive(controller)
    assert controller.phase is Phase.FAILED
    error = controller.error
    assert isinstance(error, RecoveryError)
    text = str(error)
    assert f"worker {TOP.worker(FLAKY)} (rank {FLAKY})" in text
    assert "Connection reset by peer" in text and "comm_retries=2" in text
    assert len(raised) == 3  # the first try and two retries, then no more
    gaps = [b - a for a, b in itertools.pairwise(raised)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # the wait doubles


def test_a_passing_comm_error_is_retried_and_the_job_ends_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clean, _ = make(mlp_spec(), TOP)
    drive(clean)
    raised = plant_resets(monkeypatch, times=2)
    controller, _ = make(mlp_spec(), TOP, policy=RecoveryPolicy(comm_retries=2))
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    assert len(raised) == 2
    assert [e.cause for e in controller.events] == ["communication error"] * 2
    assert all(e.lost == [] for e in controller.events)
    for key, state in clean.final_states.items():  # type: ignore[attr-defined]
        for name, value in state["model"].items():
            assert torch.equal(controller.final_states[key]["model"][name], value), (key, name)  # type: ignore[attr-defined]


def test_the_count_starts_again_after_a_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resets at two different steps, each within the budget, are not added up."""
    monkeypatch.setattr(decisions, "COMM_BACKOFF_S", 0.01)
    real = StageWorker.run_step
    raised: list[int] = []

    def run_step(self: StageWorker, step: int, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.rank == FLAKY and step in (1, 3) and raised.count(step) < 1:
            raised.append(step)
            _gloo_reset()
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(StageWorker, "run_step", run_step)
    controller, _ = make(mlp_spec(), TOP, policy=RecoveryPolicy(comm_retries=1))
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    assert raised == [1, 3]


def test_comm_retries_is_checked() -> None:
    with pytest.raises(ValueError, match="comm_retries"):
        RecoveryPolicy(comm_retries=-1)
