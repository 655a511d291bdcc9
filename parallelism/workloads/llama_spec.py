"""The LLaMA workload as a job: `llama_spec` builds the `TrainSpec` of a LLaMA-style decoder
(`parallelism.workloads.llama`) on byte-level text (`parallelism.workloads.data`), trained
with AdamW (`adamw`) and a linear warmup (`parallelism.spec.linear_warmup`).

A recipe, not part of the core: `parallelism.spec` knows no workload, and this module is
where the model, its data and its optimizer meet.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch
from torch import nn

from parallelism.checks import check_bool, check_int, check_number
from parallelism.datasets import TokenWindows, batches_from_dataset
from parallelism.spec import BatchFn, ScheduleName, TrainSpec, linear_warmup
from parallelism.workloads.data import LMBatches, TokenCorpus
from parallelism.workloads.llama import (
    LlamaConfig,
    LlamaPreset,
    build_llama_stage,
    edge_replica_keys,
    llama_loss,
    partition_layers,
)

__all__ = ["adamw", "llama_spec"]


def llama_spec(
    *,
    preset: LlamaPreset = "tiny",
    data: str | os.PathLike[str] | None = None,
    seq_len: int | None = None,
    microbatch_size: int = 4,
    microbatches: int = 4,
    lr: float = 3e-3,
    warmup_steps: int = 20,
    weight_decay: float = 0.1,
    clip_grad_norm: float | None = 1.0,
    schedule: ScheduleName = "1f1b",
    seed: int = 0,
    max_bytes: int = 8_000_000,
    checkfree_plus: bool = False,
    shard_optimizer: bool = False,
    global_batch_size: int | None = None,
    **config_overrides: int | float,
) -> TrainSpec:
    """A LLaMA-style decoder trained on byte-level text.

    Args:
        preset: model size, ``"tiny"`` (tests), ``"demo"``, ``"small"`` (~25M parameters)
            or ``"medium"`` (`LlamaPreset`).
        data: a text, ``.bin`` (uint16 tokens) or ``.npy`` file, or a directory of
            ``.txt`` files; by default the Python standard library's source code.
        seq_len: tokens per sample (default: the preset's ``max_seq_len``).
        microbatch_size, microbatches: samples per microbatch, microbatches per replica.
        lr, warmup_steps, weight_decay: AdamW with linear warmup then constant rate.
        schedule: the pipeline schedule, ``"1f1b"`` or ``"gpipe"``.
        checkfree_plus: train for CheckFree+ recovery: swapped routes on odd
            microbatches, and replicas of the embedding on stage 1 and of the head on
            stage ``S-2`` (needs ``RecoveryPolicy(approximate="checkfree+")`` to be used).
        shard_optimizer: ZeRO-1 -- AdamW state sharded over each stage's replicas,
            each shard mirrored on the ring neighbour.
        global_batch_size: samples per step over all replicas, whatever their number:
            the corpus's non-overlapping windows read in a seeded order per epoch
            (`batches_from_dataset` over `TokenWindows`), so the job can resume on another
            topology (``Trainer(resume="reshard")``) with the same samples in every step.
            None (default): ``microbatch_size * microbatches`` windows per replica, drawn
            at random offsets (`LMBatches`).
        config_overrides: fields of `LlamaConfig` to change (``dim=``, ``n_layers=``...).

    Raises:
        ValueError: for an unknown preset (naming the known ones), a bad size, a flag that
            is not a bool, or a missing data file.
    """
    check_number("lr", lr, positive=True)
    check_number("weight_decay", weight_decay, minimum=0.0)
    check_int("warmup_steps", warmup_steps, minimum=0)
    check_bool("checkfree_plus", checkfree_plus)
    check_bool("shard_optimizer", shard_optimizer)
    if data is None:
        corpus = TokenCorpus.stdlib(max_bytes=max_bytes)
    else:
        corpus = TokenCorpus.from_path(data)
    config = LlamaConfig.preset(preset, vocab_size=corpus.vocab_size, **config_overrides)
    seq = config.max_seq_len if seq_len is None else seq_len
    if seq > config.max_seq_len:
        raise ValueError(f"seq_len {seq} exceeds the model's max_seq_len {config.max_seq_len}")
    data_fn = LMBatches(
        corpus,
        seq_len=seq,
        microbatch_size=microbatch_size,
        microbatches=microbatches,
        seed=seed,
    )
    batches: BatchFn = data_fn
    val_batches: BatchFn = data_fn.validation
    if global_batch_size is not None:
        batches = batches_from_dataset(
            TokenWindows(corpus, seq), global_batch_size=global_batch_size, seed=seed
        )
        val_batches = batches_from_dataset(
            TokenWindows(corpus, seq, "val"), global_batch_size=global_batch_size, seed=seed
        )
    build = functools.partial(build_llama_stage, config)
    if checkfree_plus:
        build = functools.partial(build_llama_stage, config, edge_replicas=True, replica_seed=seed)
    return TrainSpec(
        build_stage=build,
        loss_fn=llama_loss,
        make_optimizer=functools.partial(adamw, lr=lr, weight_decay=weight_decay),
        batches=batches,
        val_batches=val_batches,
        microbatches=microbatches,
        seed=seed,
        schedule=schedule,
        clip_grad_norm=clip_grad_norm,
        lr_schedule=functools.partial(linear_warmup, warmup_steps=warmup_steps),
        check_stages=functools.partial(partition_layers, config),
        routes="swapped" if checkfree_plus else "natural",
        shared_params=edge_replica_keys if checkfree_plus else None,
        shard_optimizer=shard_optimizer,
        name=f"llama-{preset}"
        + ("-checkfree+" if checkfree_plus else "")
        + ("-zero1" if shard_optimizer else ""),
    )


def adamw(
    params: Iterable[nn.Parameter], *, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW as LLaMA-style models train with it (betas 0.9/0.95)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
