"""A user callback that raises inside a worker reaches the user as a `CallbackError` naming
the callback, the step and the worker, with the user's own exception as its cause."""

from __future__ import annotations

import time

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


# -- a user's error is the user's, whatever it says (issue 33 item 11) --------------------


def batches_whose_server_resets(step: int, replica: int, num_replicas: int):  # type: ignore[no-untyped-def]
    if step == 2 and replica == 1:
        raise OSError("Connection reset")  # the user's own data server, not a peer
    return regression_batches(step, replica, num_replicas)


def batches_whose_read_times_out(step: int, replica: int, num_replicas: int):  # type: ignore[no-untyped-def]
    if step == 2 and replica == 1:
        raise TimeoutError("gloo-like text: connection timed out")
    return regression_batches(step, replica, num_replicas)


@pytest.mark.parametrize(
    "batches", [batches_whose_server_resets, batches_whose_read_times_out], ids=["reset", "timeout"]
)
def test_a_connection_error_in_the_users_data_is_theirs_not_a_lost_peers(batches: object) -> None:
    """Classified by the words in it ("connection", "timeout"), a user's own error was
    taken for a peer's death: the step retried, workers blamed and replaced, and the job
    ended (if at all) far from the cause. It ends the job at once, named."""
    started = time.monotonic()
    controller = None
    with pytest.raises(CallbackError, match=r"batches\(2, 1, 2\) raised") as info:
        controller, _ = make(mlp_spec(batches=batches), Topology(2, 2))
        drive(controller)
    assert isinstance(info.value.__cause__, OSError)
    assert controller is not None and not controller.events  # nothing recovered
    assert time.monotonic() - started < 30


class _ResetsOnItsSixthCall(torch.nn.Module):
    """A stage whose user code (its forward) raises a connection error of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp_stage(0, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 6:
            raise ConnectionResetError(104, "Connection reset by peer")
        return self.inner(x)  # type: ignore[no-any-return]


def stage_that_resets(stage: int, num_stages: int) -> torch.nn.Module:
    return _ResetsOnItsSixthCall() if stage == 1 else mlp_stage(stage, num_stages)


def test_a_connection_error_in_the_users_model_is_raised_as_itself() -> None:
    started = time.monotonic()
    controller = None
    with pytest.raises(ConnectionResetError, match="Connection reset by peer"):
        controller, _ = make(mlp_spec(build_stage=stage_that_resets), Topology(2, 2))
        drive(controller)
    assert controller is not None and not controller.events  # nothing recovered
    assert time.monotonic() - started < 30
