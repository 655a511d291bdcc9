"""Small workloads for tests: user-style callbacks, shipped to Ray workers by value."""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from recovery import TrainSpec
from recovery.worker import StageWorker


def mlp_stage(stage: int, num_stages: int, width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh())


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def adamw(params, lr: float = 1e-2) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=lr)


def sgd(params, lr: float = 0.1) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=lr)


def regression_batches(
    step: int, replica: int, num_replicas: int, *, size: int = 8, width: int = 16
):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(size, width, generator=g)
    return x, torch.sin(x)


def mlp_spec(**overrides) -> TrainSpec:  # type: ignore[no-untyped-def]
    """A user-defined spec: an MLP regression, one Linear+Tanh per stage."""
    kwargs = dict(
        build_stage=mlp_stage,
        loss_fn=mse,
        make_optimizer=adamw,
        batches=regression_batches,
        microbatches=4,
    )
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


@functools.cache
def tiny_llama(schedule: str = "1f1b", microbatches: int = 4, seed: int = 0) -> TrainSpec:
    """The built-in LLaMA workload at test size (cached: the corpus loads once)."""
    return TrainSpec.llama(
        preset="tiny",
        seq_len=32,
        microbatch_size=2,
        microbatches=microbatches,
        schedule=schedule,
        seed=seed,
        max_bytes=2_000_000,
    )


class EchoWorker(StageWorker):
    """A worker with a few trivial methods, for the `WorkerGroup` conformance test."""

    def echo(self, value: object) -> object:
        return value

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def boom(self) -> None:
        raise KeyError("user code failed")
