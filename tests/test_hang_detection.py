"""Hang detection from progress, not from the step's start: a long healthy step is not a
hang; a stuck worker is found within ``hang_timeout_s`` (plus a probe interval) of its
last progress, and only it is killed."""

from __future__ import annotations

import time

import torch
from torch import nn

from parallelism import Topology
from recovery import Hang, KillPoint, RecoveryPolicy, Timeouts
from tests.jobs import drive, make
from tests.test_controller import assert_equal_states
from tests.workloads import mlp_spec

HANG_S = 0.6


class Slow(nn.Module):
    """A stage whose every forward takes 0.35 s: a step of 4 microbatches over 2 stages
    takes ~1.8 s (three times the hang timeout) while each action stays under it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.35)
        return torch.tanh(self.layer(x))


def slow_stage(stage: int, num_stages: int) -> nn.Module:
    return Slow()


def test_a_long_healthy_step_is_not_a_hang() -> None:
    policy = RecoveryPolicy(timeouts=Timeouts(hang=HANG_S))
    controller, _ = make(mlp_spec(build_stage=slow_stage), Topology(2, 1), policy=policy, steps=2)
    started = time.monotonic()
    drive(controller)
    took = time.monotonic() - started
    assert controller.step == 2 and not controller.events, controller.events
    assert took / 2 > 2 * HANG_S  # the steps really were longer than the timeout


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
    assert HANG_S <= event.breakdown["detect"] < HANG_S * 1.25 + 1.0, event.breakdown
    assert_equal_states(controller.final_states, clean.final_states)  # type: ignore[attr-defined]
