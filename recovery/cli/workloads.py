"""The small jobs the programs train: an MLP regression (``chaos``, ``gpu_check``) and a
CNN with BatchNorm and dropout (``chaos --model bn-cnn``).

Module-level functions, so that Ray ships them to the workers by reference: a worker
imports this module from the installed package.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recovery import TrainSpec

WIDTH = 16
MODELS = ("mlp", "bn-cnn")


def stage(s: int, num_stages: int) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def batches(step: int, replica: int, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(8, WIDTH, generator=g)
    return x, torch.sin(x)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def spec(seed: int, model: str = "mlp") -> TrainSpec:
    """The job: an MLP regression, or (``bn-cnn``) a CNN with BatchNorm and dropout in every
    stage on generated shape images a random flip augments -- a model with buffers, whose
    every running statistic and batch counter the oracle checks too."""
    if model == "bn-cnn":
        from parallelism.workloads.shapes import Shapes, bn_cnn_stage
        from recovery import batches_from_dataset

        return TrainSpec(
            build_stage=bn_cnn_stage,
            loss_fn=nn.functional.cross_entropy,
            make_optimizer=adamw,
            batches=batches_from_dataset(Shapes(2048, augment=True), 8, seed=seed),
            microbatches=2,
            seed=seed,
            name="bn-cnn",
        )
    return TrainSpec(
        build_stage=stage,
        loss_fn=mse,
        make_optimizer=adamw,
        batches=batches,
        microbatches=4,
        seed=seed,
    )
