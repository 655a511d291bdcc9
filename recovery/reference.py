"""Plain single-process training of a `TrainSpec`: the oracle and the baseline.

`train_reference` runs the same model (the same stages, built with the same seeds) on the
same global batch -- every replica's batch of a step, concatenated -- in one process, with
no pipeline, no microbatches and no communication. Pipeline x data-parallel training must
reproduce its losses and weights up to float32 rounding; the benchmarks use it as the
framework-free speed baseline.

`differences` is the oracle's comparison: a job that recovered exactly ends with the losses
and the final states of the run that never failed (this reference, or a job that never
failed), bit for bit; `relative_difference` is the norm-wise gap an approximate one is
held to.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from parallelism.comm import Activation
from parallelism.engine import call_stage, clip_gradients
from parallelism.seeding import seed_everything
from parallelism.spec import Batch, TrainSpec, apply_lr_schedule


@dataclass
class ReferenceResult:
    losses: list[float]
    states: list[dict[str, torch.Tensor]]
    """Final state_dict of each stage."""
    step_s: list[float] = field(default_factory=list)
    grad_norms: list[list[float]] = field(default_factory=list)

    def state(self, stage: int) -> dict[str, torch.Tensor]:
        return self.states[stage]


def train_reference(
    spec: TrainSpec,
    *,
    stages: int,
    replicas: int,
    steps: int,
    accumulate: int = 1,
    device: str | torch.device = "cpu",
) -> ReferenceResult:
    """Train ``spec``'s ``stages`` stages as one model in this process.

    The global batch of a step is ``batches(step, r, replicas)`` for every replica ``r``,
    concatenated; the loss is its mean (the same objective the pipeline optimises with
    ``microbatches`` microbatches per replica and the gradient averaged over replicas).
    With ``accumulate=k`` the global batch runs as k equal chunks whose gradients add up
    (gradient accumulation: the same arithmetic shapes as k microbatches).

    ``device``: where the model trains (each stage is built on the CPU from its seed, then
    moved there, as a worker does); on the CPU nothing is moved. The returned states are
    on the CPU either way. The caller turns on deterministic algorithms for CUDA if it
    wants them (`parallelism.devices.deterministic_cuda`).

    Raises:
        ValueError: for a spec with sharded tables, or a last stage that does not return
            one tensor.
    """
    if spec.tables is not None:
        raise ValueError(
            "the pipeline reference does not train sharded tables; "
            "parallelism.dlrm.DLRM is their single-process reference"
        )
    where = torch.device(device)
    modules = [spec.build(s, stages).to(where) for s in range(stages)]
    optimizers = [spec.make_optimizer(m.parameters()) for m in modules]
    base_lrs = [[g["lr"] for g in opt.param_groups] for opt in optimizers]
    result = ReferenceResult(losses=[], states=[])
    for step in range(steps):
        start = time.perf_counter()
        batches = [cast(Batch, spec.batches(step, r, replicas)) for r in range(replicas)]
        inputs = torch.cat([b[0] for b in batches]).to(where)
        targets = torch.cat([b[1] for b in batches]).to(where)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        seed_everything(spec.seed, "step", 0, 0, step)
        total = 0.0
        for chunk_in, chunk_tgt in zip(
            inputs.chunk(accumulate), targets.chunk(accumulate), strict=True
        ):
            x: Activation = chunk_in
            for s, module in enumerate(modules):
                x = call_stage(module, x, first=s == 0, last=s == stages - 1, natural=True)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"the last stage must return one tensor, got {type(x).__name__}")
            loss = spec.loss_fn(x, chunk_tgt) / accumulate
            loss.backward()
            total += float(loss.detach())
        norms = []
        for module, opt, lrs in zip(modules, optimizers, base_lrs, strict=True):
            params = [p for p in module.parameters() if p.requires_grad]
            _, clipped = clip_gradients(params, spec.clip_grad_norm)
            norms.append(clipped)
            apply_lr_schedule(opt, spec.lr_schedule, step, lrs)
            opt.step()
        if where.type == "cuda":  # the optimizer step may still be queued: time it too
            torch.cuda.synchronize(where)
        result.losses.append(total)
        result.grad_norms.append(norms)
        result.step_s.append(time.perf_counter() - start)
    result.states = [_cpu_state(m) for m in modules]
    return result


def _cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def relative_difference(got: torch.Tensor, oracle: torch.Tensor) -> float:
    """``|got - oracle| / |oracle|`` in the L2 norm (0 for two zero tensors)."""
    scale = float(oracle.double().norm())
    gap = float((got.double() - oracle.double()).norm())
    return gap / scale if scale else gap


def differences(got: Any, oracle: Any, *, where: str = "", rtol: float = 0.0) -> list[str]:
    """Where ``got`` differs from ``oracle``: nested dicts / lists of tensors and numbers,
    e.g. two `FitResult.states` or two loss lists. Tensors are compared with `torch.equal`
    (same shape, dtype and every bit of value) and numbers with ``==``; empty: identical.
    With ``rtol`` > 0, floating-point values need only agree within ``rtol`` relative -- a
    tensor by the norm of its difference against its own norm, elements near zero (an
    optimizer moment) being no scale of their own -- which is what a shrunk job of three or
    more replicas reaches (see recovery/runtime/elastic.py)."""
    if isinstance(oracle, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and got.dtype == oracle.dtype):
            return [f"{where}: {type(got).__name__} vs a {oracle.dtype} tensor"]
        if rtol and oracle.is_floating_point():
            close = got.shape == oracle.shape and relative_difference(got, oracle) <= rtol
            return [] if close else [f"{where}: tensors differ by more than rtol {rtol:g}"]
        return [] if torch.equal(got, oracle) else [f"{where}: tensors differ"]
    if isinstance(oracle, Mapping):
        if not isinstance(got, Mapping) or set(got) != set(oracle):
            return [f"{where}: keys {sorted(map(str, got))} vs {sorted(map(str, oracle))}"]
        return [
            d
            for k in oracle
            for d in differences(got[k], oracle[k], where=f"{where}/{k}", rtol=rtol)
        ]
    if isinstance(oracle, list | tuple):
        if not isinstance(got, list | tuple) or len(got) != len(oracle):
            n = len(got) if isinstance(got, list | tuple) else type(got).__name__
            return [f"{where}: {n} items vs {len(oracle)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(got, oracle, strict=True))
            for d in differences(a, b, where=f"{where}[{i}]", rtol=rtol)
        ]
    if rtol and isinstance(oracle, float) and isinstance(got, float):
        ok = abs(got - oracle) <= rtol * abs(oracle)
        return [] if ok else [f"{where}: {got!r} vs {oracle!r} (rtol {rtol:g})"]
    return [] if got == oracle else [f"{where}: {got!r} vs {oracle!r}"]
