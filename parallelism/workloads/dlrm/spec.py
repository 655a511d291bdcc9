"""The DLRM workload as a job: `dlrm_spec` builds the `TrainSpec` of a DLRM whose embedding
tables are row-sharded over the workers (`DLRMTraining`), on generated click logs or a
Criteo file (`parallelism.workloads.clicks`).

A recipe, not part of the core: `parallelism.spec` knows no workload, and this module is
where the model, its data and its optimizers meet.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch
from torch import nn

from parallelism.checks import check_number
from parallelism.spec import TrainSpec
from parallelism.workloads.clicks import Categorical, ClickDataset, ClickLogs, GlobalClicks
from parallelism.workloads.dlrm.model import DenseDLRM, DLRMConfig, dlrm_loss
from parallelism.workloads.dlrm.training import DLRMTraining

__all__ = ["DLRMPreset", "dlrm_spec"]

DLRMPreset = Literal["tiny", "small"]
"""A named `DLRMConfig` (`DLRMConfig.preset`)."""


def dlrm_spec(
    *,
    preset: DLRMPreset = "tiny",
    data: str | os.PathLike[str] | None = None,
    batch_size: int = 256,
    sparse_lr: float = 0.05,
    dense_lr: float = 1e-3,
    seed: int = 0,
    zipf_alpha: float = 1.05,
    categorical: Categorical = "hash",
    global_batch_size: int | None = None,
    **config_overrides: object,
) -> TrainSpec:
    """A DLRM-style recommendation model on click logs, its tables row-sharded.

    Args:
        preset: model size, ``"tiny"`` (tests) or ``"small"`` (387,500 rows, 8 tables).
        data: a Criteo-format TSV file (see `parallelism.workloads.clicks.read_criteo`; the
            model's tables must then number 26 with 13 dense features), parsed once per
            machine into a memory-mapped cache (`ClickDataset.from_criteo`; the spec
            carries the path, not the samples); by default generated click logs with
            Zipf ids and a planted truth.
        batch_size: samples per worker per step.
        sparse_lr, dense_lr: row-wise Adagrad of the rows, Adam of the dense part.
        categorical: how the Criteo file names rows, ``"hash"`` or ``"index"``.
        global_batch_size: samples per step over all workers, whatever their number (one
            draw per step, each worker its run of it: `GlobalClicks`), so the job can
            resume on another worker count (``Trainer(resume="reshard")``, the rows
            redistributed by range); None (default): ``batch_size`` per worker.
        config_overrides: fields of `parallelism.workloads.dlrm.DLRMConfig` to change.

    Raises:
        ValueError: for an unknown preset, a bad size, or a bad data file.
    """
    check_number("sparse_lr", sparse_lr, positive=True)
    check_number("dense_lr", dense_lr, positive=True)
    config = DLRMConfig.preset(preset, **config_overrides)
    source: ClickLogs | ClickDataset
    if data is None:
        source = ClickLogs(
            config.table_rows,
            dense_features=config.dense_features,
            batch_size=batch_size,
            seed=seed,
            zipf_alpha=zipf_alpha,
        )
    else:
        # Parsed once into a memory-mapped cache; the spec carries only its recipe.
        source = ClickDataset.from_criteo(
            data,
            config.table_rows,
            categorical=categorical,
            dense_features=config.dense_features,
            batch_size=batch_size,
            seed=seed,
        )
    training = DLRMTraining(config, sparse_lr=sparse_lr, dense_lr=dense_lr)
    return TrainSpec(
        build_stage=functools.partial(_dense_stage, config),
        loss_fn=dlrm_loss,
        make_optimizer=functools.partial(torch.optim.Adam, lr=dense_lr),
        batches=source if global_batch_size is None else GlobalClicks(source, global_batch_size),
        val_batches=source.validation,
        microbatches=1,
        seed=seed,
        tables=training,
        name=f"dlrm-{preset}",
    )


def _dense_stage(config: DLRMConfig, stage: int, num_stages: int) -> nn.Module:
    """The dense part of a DLRM (what ``build_stage`` names for a sharded-table model)."""
    return DenseDLRM(config)
