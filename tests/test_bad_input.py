"""Bad input gets a clear ValueError before any worker starts."""

from __future__ import annotations

import pytest

from parallelism import Topology
from recovery import Trainer, TrainSpec
from recovery.runtime.membership import Membership
from tests.workloads import mlp_spec, tiny_llama


@pytest.fixture(autouse=True)
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker was started for bad input")

    monkeypatch.setattr(Membership, "start", refuse)
    monkeypatch.setattr(Membership, "start_job", refuse)
    monkeypatch.setattr("recovery.runtime.ray_group.connect", refuse)


def test_model_with_fewer_blocks_than_stages() -> None:
    with pytest.raises(ValueError, match="fewer than 5 stages"):
        Trainer(tiny_llama(), topology=Topology(5, 1)).fit(1)


def test_microbatches_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="3 microbatches do not divide the batch of 8"):
        Trainer(mlp_spec(microbatches=3), topology=Topology(2, 1)).fit(1)


def test_batches_must_be_a_pair_of_tensors() -> None:
    spec = mlp_spec(batches=lambda step, replica, n: [1, 2, 3])
    with pytest.raises(ValueError, match="must return \\(inputs, targets\\)"):
        Trainer(spec, topology=Topology(2, 1)).fit(1)


def test_missing_data_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="does not exist"):
        TrainSpec.llama(data=tmp_path / "nope.txt")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"microbatches": 0}, "microbatches must be >= 1"),
        ({"schedule": "zigzag"}, "unknown schedule 'zigzag'"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm must be positive"),
        ({"loss_fn": "mse"}, "loss_fn must be callable"),
    ],
)
def test_bad_spec_fields(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mlp_spec(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "mpi"}, "unknown backend 'mpi'"),
        ({"eval_every": -1}, "eval_every must be >= 0"),
        ({"threads_per_worker": 0}, "threads_per_worker must be >= 1"),
        ({"topology": (4, 2)}, "topology must be a Topology"),
    ],
)
def test_bad_trainer_arguments(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"topology": Topology(2, 1), **kwargs}
    with pytest.raises(ValueError, match=message):
        Trainer(mlp_spec(), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_bad_step_count(steps: object) -> None:
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        Trainer(mlp_spec(), topology=Topology(2, 1)).fit(steps)  # type: ignore[arg-type]
