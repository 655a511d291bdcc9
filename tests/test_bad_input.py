"""Bad input gets a clear ValueError before any worker starts."""

from __future__ import annotations

import pytest
import torch

from parallelism import Topology
from parallelism.workloads.llama_spec import llama_spec
from recovery import RecoveryPolicy, Trainer
from recovery.integrity.fingerprint import RECOMMENDED_FINGERPRINT_EVERY
from recovery.runtime.membership import Membership
from tests.workloads import mlp_spec, tiny_llama


@pytest.fixture(autouse=True)
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker was started for bad input")

    monkeypatch.setattr(Membership, "start", refuse)
    monkeypatch.setattr(Membership, "start_job", refuse)
    monkeypatch.setattr("recovery.groups.ray_group.connect", refuse)


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
        llama_spec(data=tmp_path / "nope.txt")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"microbatches": 0}, "microbatches must be >= 1"),
        ({"schedule": "zigzag"}, "schedule must be one of '1f1b', 'gpipe'; got 'zigzag'"),
        ({"routes": "reversed"}, "routes must be one of 'natural', 'swapped'; got 'reversed'"),
        ({"shard_optimizer": "no"}, "shard_optimizer must be True or False, got 'no'"),
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
        ({"backend": "mpi"}, "backend must be one of 'gloo', 'nccl'; got 'mpi'"),
        ({"device": "gpu"}, "unknown device 'gpu'; choose one of"),
        ({"eval_every": -1}, "eval_every must be an integer >= 0, got -1"),
        ({"threads_per_worker": 0}, "threads_per_worker must be an integer >= 1, got 0"),
        ({"progress": "no"}, "progress must be True or False, got 'no'"),
        ({"collect_states": "false"}, "collect_states must be True or False, got 'false'"),
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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1.0}, "lr must be a positive number, got -1.0"),
        ({"lr": float("nan")}, "lr must be a positive number, got nan"),
        ({"weight_decay": -0.1}, "weight_decay must be a number >= 0.0, got -0.1"),
        ({"warmup_steps": -3}, "warmup_steps must be an integer >= 0, got -3"),
        ({"lr": True}, "lr must be a positive number, got True"),
        ({"checkfree_plus": "false"}, "checkfree_plus must be True or False, got 'false'"),
        ({"preset": "huge"}, "unknown LlamaConfig preset 'huge'; known: tiny, demo"),
    ],
)
def test_bad_llama_hyperparameters(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama_spec(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_recoveries": True}, r"max_recoveries must be an integer >= 0 or None, got True"),
        ({"timeouts": {"hang": True}}, r"timeouts\.hang must be a positive"),
        ({"hot_spares": True}, "hot_spares must be an integer >= 0, got True"),
        ({"comm_retries": True}, "comm_retries must be an integer >= 0, got True"),
        ({"timeouts": {"hang": float("inf")}}, r"timeouts\.hang"),
    ],
)
def test_bad_policy_fields(kwargs: dict[str, object], message: str) -> None:
    """A bool is an int to Python; to a policy it is a mistake."""
    with pytest.raises(ValueError, match=message):
        RecoveryPolicy(**kwargs)


def test_more_hot_spares_than_workers() -> None:
    with pytest.raises(ValueError, match="hot_spares=5 exceeds the job's 4 workers"):
        Trainer(mlp_spec(), topology=Topology(2, 2), policy=RecoveryPolicy(hot_spares=5))


def test_a_refused_run_leaves_no_run_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "run"
    trainer = Trainer(mlp_spec(microbatches=3), topology=Topology(2, 1), run_dir=folder)
    with pytest.raises(ValueError, match="3 microbatches do not divide"):
        trainer.fit(1)
    assert not folder.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--stages", "0"], "Topology stages must be a positive integer, got 0"),
        (["--replicas", "0"], "Topology replicas must be a positive integer, got 0"),
        (["--lr", "-1"], "lr must be a positive number"),
        (["--lr", "nan"], "lr must be a positive number"),
        (["--hot-spares", "100"], "hot_spares=100 exceeds"),
        (["--fingerprint-every", "-1"], "fingerprint_every must be an integer >= 0"),
        (["--fingerprint-every", "5", "--replicas", "1"], "fingerprint_every=5 needs two"),
        (  # no K: the recommended one reaches the policy
            ["--fingerprint-every", "--replicas", "1"],
            f"fingerprint_every={RECOMMENDED_FINGERPRINT_EVERY} needs two",
        ),
        (["--elastic", "--replicas", "1"], "elastic=True needs two or more pipeline replicas"),
    ],
)
def test_bad_train_cli_arguments_make_no_folder(argv: list[str], message: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from recovery.cli.train import main

    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        main([*argv, "--out", str(out), "--steps", "2", "--failures", "none", "--no-progress"])
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, every",
    [
        ([], 0),
        (["--fingerprint-every"], RECOMMENDED_FINGERPRINT_EVERY),
        (["--fingerprint-every", "--steps", "3"], RECOMMENDED_FINGERPRINT_EVERY),
        (["--fingerprint-every", "7"], 7),
        (["--fingerprint-every", "0"], 0),
    ],
)
def test_train_cli_fingerprint_every_alone_is_the_recommended_k(
    argv: list[str], every: int
) -> None:
    """Fingerprints are off unless asked for; asked for without a K, they get the K the
    README's cost figures are for."""
    from recovery.cli.train import parse_args

    assert RECOMMENDED_FINGERPRINT_EVERY == 100
    assert parse_args(argv).fingerprint_every == every


def test_nccl_on_a_cluster_without_gpus_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from recovery.groups import ray_group
    from recovery.worker import StageWorker

    monkeypatch.setattr(
        ray_group.ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}]
    )
    group = ray_group.RayWorkerGroup(StageWorker, backend="nccl")
    with pytest.raises(ValueError, match=r"needs one GPU per worker: the job needs 5 .* has 0"):
        group.check_capacity(5)
    ray_group.RayWorkerGroup(StageWorker, backend="gloo").check_capacity(5)  # no GPU needed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_train_cli_device_cuda_without_cuda_makes_no_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from recovery.cli.train import main

    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False on the driver"):
        main(["--backend", "gloo", "--device", "cuda", "--out", str(out), "--steps", "2",
              "--failures", "none", "--no-progress"])  # fmt: skip
    assert not out.exists()
