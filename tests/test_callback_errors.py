"""A user callback that raises inside a worker reaches the user as a `CallbackError` naming
the callback, the step and the worker, with the user's own exception as its cause."""

from __future__ import annotations

import pytest
import torch

from parallelism import Topology
from recovery import Trainer
from recovery.errors import CallbackError
from tests.jobs import drive, make
from tests.workloads import mlp_spec, mlp_stage, regression_batches


class UserBug(KeyError):
    pass


def batches_failing_at_step_2(step: int, replica: int, num_replicas: int):  # type: ignore[no-untyped-def]
    if step == 2 and replica == 1:
        raise UserBug("no such sample")
    return regression_batches(step, replica, num_replicas)


def stage_failing_to_build(stage: int, num_stages: int) -> torch.nn.Module:
    if stage == 1:
        raise ValueError("bad width")
    return mlp_stage(stage, num_stages)


def loss_that_raises(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise ArithmeticError("loss diverged")


@pytest.mark.parametrize(
    ("overrides", "cause", "message"),
    [
        (
            {"batches": batches_failing_at_step_2},
            UserBug,
            r"batches\(2, 1, 2\) raised UserBug: 'no such sample' \(in worker stage \d, "
            r"replica 1, at step 2\)",
        ),
        (
            {"build_stage": stage_failing_to_build},
            ValueError,
            r"build_stage\(1, 2\) raised ValueError: bad width \(in worker stage 1, replica \d, "
            r"at start-up\)",
        ),
        (
            {"loss_fn": loss_that_raises},
            ArithmeticError,
            r"loss_fn\(<Tensor \(2, 16\)>, <Tensor \(2, 16\)>\) raised ArithmeticError: loss "
            r"diverged \(in worker stage 1, replica \d, at step 0\)",
        ),
    ],
    ids=["batches", "build_stage", "loss_fn"],
)
def test_a_raising_callback_names_itself_the_step_and_the_worker(
    overrides: dict[str, object], cause: type[Exception], message: str
) -> None:
    controller = None
    with pytest.raises(CallbackError, match=message) as info:
        controller, _ = make(mlp_spec(**overrides), Topology(2, 2))
        drive(controller)
    assert isinstance(info.value.__cause__, cause)
    assert info.value.callback.split("(")[0] == next(iter(overrides))
    assert controller is None or not controller.events  # not mistaken for a lost worker


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_through_ray_the_user_gets_the_callback_error_not_a_ray_wrapper() -> None:
    trainer = Trainer(mlp_spec(batches=batches_failing_at_step_2), topology=Topology(2, 2))
    with pytest.raises(CallbackError, match=r"batches\(2, 1, 2\) raised UserBug") as info:
        trainer.fit(4)
    assert type(info.value) is CallbackError
    assert isinstance(info.value.__cause__, UserBug)
    assert str(info.value.__cause__) == "'no such sample'"
