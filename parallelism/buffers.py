"""A stage's buffers in a step: pending until the commit, equal on every replica after it.

[Note: buffers are state]
A module's buffers (BatchNorm's running mean and variance and its batch counter) change in
its forward passes. Left to themselves, the replicas of a stage would each keep the
statistics of their own data and drift apart from the first step; a step abandoned after
some forward passes would leave them in the survivors; and a replica copy would hand a
replacement another replica's statistics. So a stage treats the buffer values a training
step computes as it treats the step's gradients (`StageBuffers`):

- pending until the commit: `StageBuffers.begin` keeps the committed values before the
  schedule runs, `StageBuffers.collect` takes what the schedule computed and puts the
  committed values back, `StageBuffers.apply` (the commit) writes the new ones, and
  `StageBuffers.drop` (a step abandoned, possibly half-way through its schedule) puts the
  committed values back. Between two steps the module holds committed values only, which
  is what fingerprints, snapshots, transfers and evaluation read.
- averaged over the stage's replicas: every buffer of a number type is summed over the
  stage group in float64 and divided by the job's replica count, then cast back, so every
  replica commits the same bits. float64 holds the sum of a few float32 (or bfloat16, or
  integer) values exactly, so a buffer the step leaves unchanged (a constant table) keeps
  its bits, a counter stays an integer, and the result hardly depends on the order of the
  additions: a shrunk job, whose complete pipelines compute a missing one's share (see
  [Note: elastic shrink] in recovery/runtime/elastic.py), adds its shares' values the same
  way, each share starting from the committed values. Boolean buffers are taken as this
  replica computed them.

This is where checkfree differs from DDP: DDP's ``broadcast_buffers=True`` overwrites every
rank's buffers with rank 0's at the start of each forward, so rank 0's statistics win and
the others' are discarded (with ``False`` they drift apart). Averaging keeps every
replica's statistics -- like computing them over the global batch's microbatches in
replica order -- needs no distinguished replica, and commits them with the step, so a
replica copy and a rollback are exact. It costs one small all-reduce per step, and
nothing for a module without buffers.

Only persistent buffers are state (`persistent_buffers`): a non-persistent one is not in
the ``state_dict``, so it is neither moved nor stored; a module rebuilds it (a RoPE table,
a causal mask) and must not change it in forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from parallelism.comm import StageComm, Waitable

__all__ = ["StageBuffers", "evaluating", "persistent_buffers"]


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s persistent buffers by qualified name (those in its ``state_dict``), each
    once, in ``named_buffers`` order."""
    found = []
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        skip: set[str] = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buf in sub.named_buffers(recurse=False):
            if buf is None or name in skip or id(buf) in seen:
                continue
            seen.add(id(buf))
            found.append((f"{prefix}.{name}" if prefix else name, buf))
    return found


def _averaged(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or (dtype != torch.bool and not dtype.is_complex)


class StageBuffers:
    """A stage's persistent buffers through a training step (see [Note: buffers are state]).

    Args:
        module: the stage's module.
        replicas: the job's replica count (what the sums are divided by).
    """

    def __init__(self, module: nn.Module, replicas: int) -> None:
        self.buffers = [buf for _, buf in persistent_buffers(module)]
        self.replicas = replicas
        self._averaged = [i for i, b in enumerate(self.buffers) if _averaged(b.dtype)]
        self._committed: list[torch.Tensor] | None = None
        """The values before the step's schedule ran (between `begin` and the commit or
        abandon); None: no step under way."""
        self._sum: torch.Tensor | None = None
        """The step's averaged buffers, flat in float64: summed over the shares here, then
        over the stage group; divided by the replica count in `finish`."""
        self._own: list[torch.Tensor] | None = None
        """The values the first share computed (what non-averaged buffers take)."""
        self._pending: list[torch.Tensor] | None = None
        """The values the commit applies."""

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def begin(self) -> None:
        """A training step starts: keep the committed values (to put back after it)."""
        if not self.buffers:
            return
        if self._committed is None:
            self._committed = [b.detach().clone() for b in self.buffers]
        self._sum = self._own = self._pending = None

    def collect(self) -> None:
        """A share's schedule has run: add the values it computed to the step's sum and put
        the committed values back (the next share, if any, starts from them too)."""
        if not self.buffers:
            return
        assert self._committed is not None, "begin() first"
        with torch.no_grad():
            computed = [self.buffers[i].detach().reshape(-1).double() for i in self._averaged]
            flat = torch.cat(computed) if computed else torch.zeros(0, dtype=torch.float64)
            flat = flat.to(self.buffers[0].device)
            if self._sum is None:
                self._sum = flat.clone()
                self._own = [b.detach().clone() for b in self.buffers]
            else:
                self._sum.add_(flat)
            self._restore()

    def reduce(self, comm: StageComm | None) -> Waitable | None:
        """Start summing the step's buffers over the stage group (None: nothing to start).
        A member that computed no share contributes zeros."""
        if not self.buffers or not self._averaged:
            return None
        if self._sum is None:  # no share here (a shrunk job's incomplete pipeline)
            total = sum(self.buffers[i].numel() for i in self._averaged)
            self._sum = torch.zeros(total, dtype=torch.float64, device=self.buffers[0].device)
        if self.replicas < 2 or comm is None:
            return None
        return comm.allreduce_stage(self._sum)

    def finish(self, comm: StageComm | None, work: Waitable | None) -> None:
        """Wait for `reduce`'s sum and make the values the commit applies."""
        if not self.buffers:
            return
        if work is not None:
            assert comm is not None
            comm.wait(work)
        own = self._own if self._own is not None else [b.detach().clone() for b in self.buffers]
        pending = list(own)
        if self._sum is not None and self._averaged:
            mean = self._sum / self.replicas
            offset = 0
            for i in self._averaged:
                buf = self.buffers[i]
                part = mean[offset : offset + buf.numel()].view(buf.shape)
                if not buf.dtype.is_floating_point:
                    part = part.round()
                pending[i] = part.to(buf.dtype)
                offset += buf.numel()
        self._pending = pending

    def apply(self) -> None:
        """The commit: the step's buffers become the committed ones."""
        if not self.buffers:
            return
        if self._pending is not None:
            with torch.no_grad():
                for buf, value in zip(self.buffers, self._pending, strict=True):
                    buf.copy_(value)
        self._committed = self._sum = self._own = self._pending = None

    def drop(self) -> None:
        """The step is abandoned: put the committed values back (its schedule may have
        stopped half-way, with some forward passes in the buffers)."""
        if not self.buffers:
            return
        if self._committed is not None:
            with torch.no_grad():
                self._restore()
        self._committed = self._sum = self._own = self._pending = None

    def _restore(self) -> None:
        assert self._committed is not None
        for buf, value in zip(self.buffers, self._committed, strict=True):
            buf.copy_(value)


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Run ``module`` for evaluation and leave no trace in it: every submodule in eval mode
    (each one's own mode given back after), no autograd, and every buffer given back its
    value -- even a module that updates a buffer in eval mode changes nothing a training
    step reads. (The random streams are the caller's: `parallelism.seeding.Randomness.kept`.)"""
    modes = [(sub, sub.training) for sub in module.modules()]
    kept = [(buf, buf.detach().clone()) for _, buf in module.named_buffers()]
    try:
        with torch.no_grad():
            module.eval()
            yield
    finally:
        for sub, training in modes:
            sub.training = training
        with torch.no_grad():
            for buf, value in kept:
                buf.copy_(value)
