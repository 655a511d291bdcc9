"""The small jobs the programs train: an MLP regression (``chaos``, ``gpu_check``), a
CNN with BatchNorm and dropout (``chaos --model bn-cnn``), and a wider MLP whose stages
compute for milliseconds a step (``chaos --throttle``, ``bench stragglers``: a straggler
shows in compute time only where there is compute to slow).

Module-level functions, so that Ray ships them to the workers by reference: a worker
imports this module from the installed package.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recovery import TrainSpec

WIDTH = 16
WIDE = 512
"""The wide MLP's width (batches of `WIDE_BATCH` samples): ~5 ms of compute per stage and
step on one core of the 2-core test machine."""
WIDE_BATCH = 64
MODELS = ("mlp", "bn-cnn", "wide-mlp")


def stage(s: int, num_stages: int) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def batches(step: int, replica: int, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(8, WIDTH, generator=g)
    return x, torch.sin(x)


def wide_stage(s: int, num_stages: int) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh())


def wide_batches(step: int, replica: int, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(WIDE_BATCH, WIDE, generator=g)
    return x, torch.sin(x)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def spec(seed: int, model: str = "mlp") -> TrainSpec:
    """The job: an MLP regression, or (``bn-cnn``) a CNN with BatchNorm and dropout in every
    stage on generated shape images a random flip augments -- a model with buffers, whose
    every running statistic and batch counter the oracle checks too; or (``wide-mlp``) the
    MLP at width `WIDE`."""
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
    wide = model == "wide-mlp"
    return TrainSpec(
        build_stage=wide_stage if wide else stage,
        loss_fn=mse,
        make_optimizer=adamw,
        batches=wide_batches if wide else batches,
        microbatches=4,
        seed=seed,
    )
