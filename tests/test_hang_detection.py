"""Hang detection from progress, not from the step's start: a long healthy step is not a
hang; a stuck worker is found within ``hang_timeout_s`` (plus a probe interval) of its
last progress, and only it is killed."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from parallelism import Topology
from recovery import Hang, KillPoint, RecoveryPolicy, Timeouts
from recovery.groups.group import Call, CallResults, WorkerLost, seconds
from recovery.runtime.detection import _find_hung
from tests.jobs import drive, make
from tests.test_controller import assert_equal_states
from tests.workloads import mlp_spec

HANG_S = 0.6
"""The hang timeout of the stuck-worker test."""

LONG_STEP_HANG_S = 1.5
"""The hang timeout of the long-healthy-step test: each of its actions takes a third of it,
so a worker thread starved for a second beside a loaded machine (as one was, beside the Ray
tests under ``-n 2``, when this was 0.6 s against 0.35 s actions) is still no hang."""


class Slow(nn.Module):
    """A stage whose every forward takes 0.5 s: a step of 4 microbatches over 2 stages
    takes several times the long-step test's hang timeout (the test checks over 1.5 times)
    while each action stays under it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.5)
        return torch.tanh(self.layer(x))


def slow_stage(stage: int, num_stages: int) -> nn.Module:
    return Slow()


def test_a_long_healthy_step_is_not_a_hang() -> None:
    policy = RecoveryPolicy(timeouts=Timeouts(hang=LONG_STEP_HANG_S))
    controller, _ = make(mlp_spec(build_stage=slow_stage), Topology(2, 1), policy=policy, steps=2)
    started = time.monotonic()
    drive(controller)
    took = time.monotonic() - started
    assert controller.step == 2 and not controller.events, controller.events
    assert took / 2 > 1.5 * LONG_STEP_HANG_S  # the steps really were longer than the timeout


def test_a_stuck_worker_is_found_from_its_last_progress() -> None:
    top = Topology(2, 2)
    clean, _ = make(mlp_spec(), top)
    drive(clean)
    policy = RecoveryPolicy(timeouts=Timeouts(hang=HANG_S))
    stuck = Hang(step=2, stage=1, replica=1, at=KillPoint.MID_PIPELINE)
    controller, _ = make(mlp_spec(), top, stuck, policy=policy)
    drive(controller)
    (event,) = controller.events
    assert event.cause == "hung" and event.lost == [(1, 1)]  # the victims waiting on it live
    # detect = from the hang to the controller acting: the timeout, plus at most one probe
    # interval (a quarter of it) and the probe's answer.
    assert HANG_S <= event.breakdown["detect"] < HANG_S * 1.25 + 2.0, event.breakdown
    assert_equal_states(controller.final_states, clean.final_states)  # type: ignore[attr-defined]


class _LateControl:
    """Workers whose control threads answer a probe after ``late[rank]`` seconds -- a C
    call holding the GIL, say -- simulated: `gather` returns what answered within its
    timeout, the rest as lost (what a real group does with a call that timed out). Each
    worker has been silent for ``idle_s`` and waits on nobody."""

    def __init__(self, late: dict[int, float], idle_s: float) -> None:
        self.late = late
        self.idle_s = idle_s

    def submit(self, rank: int, method: Any, *args: Any) -> Call:
        return Call(rank, method.__name__, None)

    def gather(self, calls: dict[int, Call], timeout: timedelta | float) -> CallResults:
        out = CallResults()
        for rank in calls:
            if self.late[rank] <= seconds(timeout):
                out.results[rank] = {"idle_s": self.idle_s, "waiting_on": None}
            else:
                out.lost[rank] = WorkerLost(rank, f"no answer within {timeout}")
        return out


def test_a_control_thread_that_answers_late_is_not_a_hang() -> None:
    """Under the default hang timeout (120 s), a healthy worker in a long step whose
    control thread answers the probe only after 6 s (the GIL held by a C call) is not a
    culprit: the probe's patience is a share of the hang timeout, not a fixed 5 s."""
    group = _LateControl({0: 0.001, 1: 6.0}, idle_s=20.0)
    assert _find_hung(group, [0, 1], 120.0) == set()  # type: ignore[arg-type]


def test_a_control_thread_silent_past_the_patience_is_a_hang() -> None:
    group = _LateControl({0: 0.001, 1: 1e9}, idle_s=20.0)
    assert _find_hung(group, [0, 1], 120.0) == {1}  # type: ignore[arg-type]
    group = _LateControl({0: 0.001, 1: 5.5}, idle_s=0.1)  # a tiny hang timeout: a 5 s floor
    assert _find_hung(group, [0, 1], 0.6) == {1}  # type: ignore[arg-type]
