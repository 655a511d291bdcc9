"""What to train: the user's model, loss, optimizer and data, as plain callbacks.

`TrainSpec` is the contract between a user and the runtime: how one training job is laid
out (model stages, loss, optimizer, data); it knows nothing of failures. Every callback
runs inside the workers (so it must be picklable -- module-level functions,
``functools.partial`` or closures over picklable values all work) and must be
deterministic: the runtime relies on ``batches(step, replica, num_replicas)`` returning the
same tensors every time it is asked, which is what lets a rebuilt worker resume exactly
where the lost one stopped. `TrainSpec.from_module` cuts a user's whole model into stages.
The built-in workloads live beside their models and build a `TrainSpec` (this module
imports none of them): `parallelism.workloads.llama_spec.llama_spec`, a LLaMA-style decoder
on real text, and `parallelism.workloads.dlrm.spec.dlrm_spec`, a recommendation model whose
embedding tables are sharded over the workers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias, get_args

import torch
from torch import nn

from parallelism.checks import check_bool, check_choice
from parallelism.schedule import SCHEDULES
from parallelism.seeding import seed_everything
from parallelism.split import ModelSplit
from parallelism.topology import Topology

if TYPE_CHECKING:
    from parallelism.workloads.clicks import ClickBatch
    from parallelism.workloads.dlrm import DLRMTraining

__all__ = [
    "ROUTES",
    "SCHEDULE_NAMES",
    "Batch",
    "BatchFn",
    "Routes",
    "ScheduleName",
    "TrainSpec",
    "apply_lr_schedule",
    "linear_warmup",
]

Batch = tuple[torch.Tensor, torch.Tensor]
BatchFn: TypeAlias = "Callable[[int, int, int], Batch | ClickBatch]"
"""``(step, replica, num_replicas) -> batch``: (inputs, targets), or a `ClickBatch` for a
model with sharded tables."""

ScheduleName = Literal["1f1b", "gpipe"]
"""A pipeline schedule (`parallelism.schedule.SCHEDULES`)."""
SCHEDULE_NAMES: tuple[ScheduleName, ...] = get_args(ScheduleName)
assert set(SCHEDULE_NAMES) == set(SCHEDULES), "ScheduleName != SCHEDULES"
Routes = Literal["natural", "swapped"]
"""Microbatch routes through the stages (see `TrainSpec.routes`)."""
ROUTES: tuple[Routes, ...] = get_args(Routes)


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """A training job's model, loss, optimizer and data.

    Raises:
        ValueError: for a non-callable callback, ``microbatches < 1``, a schedule or routes
            not among the allowed values (naming them), a ``shard_optimizer`` that is not a
            bool, or a non-positive ``clip_grad_norm``.
    """

    build_stage: Callable[[int, int], nn.Module]
    """``(stage, num_stages) -> nn.Module``: the module of one pipeline stage. Called with
    torch's RNG seeded from ``(seed, stage)``, so every replica of a stage starts equal."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``(last-stage output, targets) -> scalar``, the mean loss over a microbatch."""
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    """``(parameters) -> optimizer`` for one stage."""
    batches: BatchFn
    """``(step, replica, num_replicas) -> (inputs, targets)``: a replica's batch for a step,
    split along dim 0 into ``microbatches`` equal microbatches. Must be deterministic."""
    microbatches: int = 4
    """Microbatches per replica per step."""
    seed: int = 0
    """Seeds the initial weights and all per-step randomness."""
    schedule: ScheduleName = "1f1b"
    """Pipeline schedule: ``"1f1b"`` or ``"gpipe"``."""
    clip_grad_norm: float | None = None
    """Clip each stage's gradient (after the data-parallel all-reduce) to this L2 norm."""
    lr_schedule: Callable[[int], float] | None = None
    """``step -> multiplier`` of each parameter group's initial learning rate."""
    val_batches: BatchFn | None = None
    """``(index, replica, num_replicas) -> (inputs, targets)`` of held-out data, if any."""
    check_stages: Callable[[int], object] | None = None
    """``num_stages -> anything``, run on the driver before any worker starts; raises
    ``ValueError`` if the model cannot be cut into that many stages."""
    routes: Routes = "natural"
    """Microbatch routes through the stages: ``"natural"``, or ``"swapped"`` (CheckFree+:
    the first two and the last two stages run in swapped order on odd microbatches; the
    stage modules must accept ``first=`` / ``last=``)."""
    shared_params: Callable[[int, int], list[str]] | None = None
    """``(stage, num_stages) -> parameter names`` the stage holds bit-identical replicas of
    with its swap partner (CheckFree+'s (de)embedding replicas); their gradients are summed
    over both holders every step. None: nothing shared."""
    shard_optimizer: bool = False
    """ZeRO-1: shard each stage's optimizer state over its replicas, every shard mirrored
    on the ring neighbour (see parallelism/zero.py). Needs at least 2 replicas; a lost
    replica's shard comes back bit-exact from the mirror (``shard_mirror``)."""
    tables: DLRMTraining | None = None
    """A recommendation model with row-sharded embedding tables (`dlrm_spec`): every
    worker holds one shard of every table and a replica of the dense part; the topology
    is one stage by ``replicas`` workers; ``batches`` returns a
    `parallelism.workloads.clicks.ClickBatch`. None: a pipeline of ``build_stage`` modules."""
    name: str = "custom"
    """A short name for logs and summaries."""

    def __post_init__(self) -> None:
        for name in ("build_stage", "loss_fn", "make_optimizer", "batches"):
            if not callable(getattr(self, name)):
                raise ValueError(f"TrainSpec.{name} must be callable, got {getattr(self, name)!r}")
        for name in ("lr_schedule", "val_batches", "check_stages"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ValueError(f"TrainSpec.{name} must be callable or None, got {value!r}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int):
            raise ValueError(f"microbatches must be an integer, got {self.microbatches!r}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        check_choice("schedule", self.schedule, SCHEDULE_NAMES)
        check_choice("routes", self.routes, ROUTES)
        check_bool("shard_optimizer", self.shard_optimizer)
        if self.shared_params is not None and not callable(self.shared_params):
            raise ValueError(
                f"TrainSpec.shared_params must be callable or None, got {self.shared_params!r}"
            )
        if self.shard_optimizer and (self.routes != "natural" or self.shared_params):
            raise ValueError(
                "shard_optimizer (ZeRO-1) does not combine with CheckFree+ training "
                "(swapped routes, shared parameters)"
            )
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive or None, got {self.clip_grad_norm}")

    # -- used by workers and by the single-process reference ------------------------------

    def build(self, stage: int, num_stages: int) -> nn.Module:
        """Build stage ``stage``'s module with the stage's deterministic initial weights.

        Raises:
            ValueError: if ``build_stage`` does not return an ``nn.Module``.
        """
        seed_everything(self.seed, "init", stage)
        module = self.build_stage(stage, num_stages)
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"build_stage({stage}, {num_stages}) returned {type(module).__name__}, not nn.Module"
            )
        return module

    def split(
        self, batch: Batch | ClickBatch, *, step: int, replica: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Split a replica's batch into ``microbatches`` (inputs, targets) chunks.

        Raises:
            ValueError: if the batch is not a pair of tensors with equal, divisible dim 0.
        """
        where = f"batch of step {step}, replica {replica}"
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            raise ValueError(
                f"{where}: batches() must return (inputs, targets), got {type(batch).__name__}"
            )
        inputs, targets = batch
        if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
            raise ValueError(f"{where}: inputs and targets must be tensors")
        if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"{where}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} "
                "must share a non-empty batch dimension 0"
            )
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"{where}: {self.microbatches} microbatches do not divide the batch of "
                f"{inputs.shape[0]} samples; pick a batch size that is a multiple of microbatches"
            )
        return list(inputs.chunk(self.microbatches)), list(targets.chunk(self.microbatches))

    def check(self, topology: Topology) -> int:
        """Validate the spec against ``topology`` on the driver, before any worker starts.

        Returns the number of target elements per step over all replicas (tokens per step
        for a language model).

        Raises:
            ValueError: if the model cannot be cut into ``topology.stages`` stages or a
                batch cannot be split into the microbatches.
        """
        if self.tables is not None:
            return self.tables.check(topology, (self.batches, self.val_batches))
        if self.check_stages is not None:
            self.check_stages(topology.stages)
        if self.shard_optimizer and topology.replicas < 2:
            raise ValueError(
                f"shard_optimizer (ZeRO-1) needs at least 2 replicas per stage, got "
                f"{topology.replicas}"
            )
        if self.routes == "swapped" and topology.stages < 4:
            raise ValueError(
                f"swapped routes (CheckFree+) need at least 4 stages, got {topology.stages}"
            )
        inputs, targets = self.split(self.batches(0, 0, topology.replicas), step=0, replica=0)
        held_out: list[torch.Tensor] = []
        if self.val_batches is not None:
            held_out, _ = self.split(self.val_batches(0, 0, topology.replicas), step=0, replica=0)
        if isinstance(self.build_stage, ModelSplit):
            self.build_stage.check_microbatch(inputs[0], "batches(0, 0, ...)")
            if held_out:
                self.build_stage.check_microbatch(held_out[0], "val_batches(0, 0, ...)")
        return sum(int(t.numel()) for t in targets) * topology.replicas

    # -- the user's own model ------------------------------------------------------------

    @classmethod
    def from_module(
        cls,
        make_model: Callable[[], nn.Module],
        *,
        example_input: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        batches: BatchFn,
        split_points: Sequence[str] | None = None,
        num_stages: int | None = None,
        microbatches: int = 4,
        seed: int = 0,
        val_batches: BatchFn | None = None,
        schedule: ScheduleName = "1f1b",
        clip_grad_norm: float | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        name: str | None = None,
    ) -> TrainSpec:
        """Train the user's whole model, cut into pipeline stages by torch's pipelining.

        Every worker builds ``make_model()`` from the job's seed and keeps its own stage,
        split off by ``torch.distributed.pipelining`` (see [Note: splitting a model] in
        ``parallelism/split.py``): the stages compute what the unsplit model computes.

        Args:
            make_model: ``() -> nn.Module``, the whole model (picklable: a module-level
                function, a class, a ``functools.partial``).
            example_input: one microbatch of inputs; every microbatch of the run must have
                its shape and dtype (the trace records them).
            loss_fn, make_optimizer, batches, val_batches: as for `TrainSpec`;
                `recovery.batches_from_dataset` makes ``batches`` from a ``Dataset``.
            split_points: module paths, each the first module of a new stage
                (``["layers.2"]``: two stages); or ``num_stages``, the job's stage count,
                for parameter-balanced points; neither: balanced for the job's topology.

        Raises:
            ValueError: for both ``split_points`` and ``num_stages``, a bad callback, or --
                on the driver before any worker starts -- a model that cannot be traced or
                split there, weights tied across stages, or an empty stage.
        """
        if split_points is not None and num_stages is not None:
            raise ValueError("give split_points or num_stages, not both")
        if num_stages is not None and (
            isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1
        ):
            raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
        splitter = ModelSplit(
            make_model=make_model,
            example_input=example_input,
            split_points=None if split_points is None else tuple(split_points),
            seed=seed,
        )
        return cls(
            build_stage=splitter,
            loss_fn=loss_fn,
            make_optimizer=make_optimizer,
            batches=batches,
            val_batches=val_batches,
            microbatches=microbatches,
            seed=seed,
            schedule=schedule,
            clip_grad_norm=clip_grad_norm,
            lr_schedule=lr_schedule,
            check_stages=functools.partial(_check_split, splitter, num_stages),
            name=name if name else str(getattr(make_model, "__name__", "module")),
        )


def _check_split(splitter: ModelSplit, num_stages: int | None, stages: int) -> list[str]:
    """`TrainSpec.from_module`'s driver-side check: the split works for the job's stages."""
    if num_stages is not None and num_stages != stages:
        raise ValueError(
            f"the model was given num_stages={num_stages}, but the job has {stages} stages"
        )
    return splitter.check(stages)


def linear_warmup(step: int, *, warmup_steps: int) -> float:
    """Learning-rate multiplier: linear warmup over ``warmup_steps``, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def apply_lr_schedule(
    optimizer: torch.optim.Optimizer,
    schedule: Callable[[int], float] | None,
    step: int,
    base_lrs: list[float],
    *,
    factor: float = 1.0,
) -> None:
    """Set each parameter group's learning rate to ``base_lrs[i] * schedule(step) * factor``.

    The rate is a pure function of the step -- no scheduler state -- so a worker rebuilt
    from any source (a replica, a checkpoint) applies exactly the rate it would have.
    ``factor`` (a rebuilt stage's CheckFree learning-rate scale) skips groups marked
    ``"shared"``: parameters replicated on another stage must keep updating identically.

    Raises:
        ValueError: if the schedule returns a negative or non-finite multiplier.
    """
    multiplier = 1.0 if schedule is None else float(schedule(step))
    if not (math.isfinite(multiplier) and multiplier >= 0):
        raise ValueError(f"lr_schedule({step}) returned {multiplier}; expected a finite value >= 0")
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * multiplier * (1.0 if group.get("shared") else factor)
