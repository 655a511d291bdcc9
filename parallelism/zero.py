"""ZeRO-1 for a pipeline stage: its optimizer state sharded over the stage's data-parallel
replicas, every shard mirrored on the ring neighbour.

[Note: ZeRO-1 with mirrors]
The parameters of a stage are partitioned over its ``R`` replicas (`partition`): replica
``r`` owns some of them and keeps optimizer state (Adam's moments) for those only. A step
is the usual two phases (see recovery/worker/stage.py): phase one runs the pipeline and
all-reduces the gradients -- every replica then holds the same full gradient -- and the
commit applies the optimizer to the *owned* parameters only. The other replicas' copies
of a parameter are refreshed at the start of the next step (or evaluation), when each
owner broadcasts its parameters over the stage group (`ZeroShard.sync`). So a replica's
authoritative state is its owned parameters and their optimizer state; the rest of its
module is a cache that the next sync overwrites.

Each shard is mirrored on the ring neighbour: replica ``r + 1`` keeps a copy of replica
``r``'s owned parameters and optimizer state (``mirror``) and applies the same update to
it at every commit, from the same all-reduced gradient. The update is a deterministic
function of identical inputs, so the mirror stays bit-identical to the owner's shard
without a byte of traffic per step: the cost is memory (the ward's parameters and
moments besides the replica's own moments: with AdamW 2.5/R of the unsharded optimizer
memory, so ZeRO-1 with mirrors saves memory from three replicas on) and the compute of a
second optimizer step over 1/R of the parameters.

When a replica dies its owned parameters and optimizer state come from its neighbour's
mirror, bit for bit; the rest of its module comes from the next sync. If the neighbour
died too, no copy of the shard is left and the job rolls back to a snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from parallelism.comm import StageComm

__all__ = ["OwnedParams", "ZeroShard", "partition"]


def partition(sizes: Sequence[int], parts: int) -> list[int]:
    """The owner of each parameter: largest first, to the least-loaded part (ties to the
    lower part, then the earlier parameter) -- balanced and deterministic.

    Raises:
        ValueError: if ``parts`` is not positive or there are fewer parameters than parts
            (some replica would own nothing).
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive integer, got {parts!r}")
    if len(sizes) < parts:
        raise ValueError(
            f"cannot shard {len(sizes)} parameter tensors over {parts} replicas: every "
            "replica must own at least one (use fewer replicas or a bigger stage)"
        )
    load = [0] * parts
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        part = min(range(parts), key=lambda p: (load[p], p))
        owner[index] = part
        load[part] += sizes[index]
    return owner


class OwnedParams(nn.Module):
    """A module over given tensors (sharing their storage), so that the state-transfer and
    snapshot functions, which move a module and its optimizer, can move one shard.

    ``buffers``: named tensors to carry too, as buffers ``buffers.0``, ``buffers.1``, ...
    in order (a stage's buffers, which belong to no shard: a replacement takes them with
    its shard)."""

    def __init__(
        self, params: Iterable[nn.Parameter], buffers: Iterable[tuple[str, torch.Tensor]] = ()
    ) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)
        held = list(buffers)
        if held:
            self.buffers_ = nn.Module()
            for index, (_, tensor) in enumerate(held):
                self.buffers_.register_buffer(str(index), tensor)


class ZeroShard:
    """One replica's share of a stage's optimizer, and its mirror of the previous replica's.

    See [Note: ZeRO-1 with mirrors].

    Args:
        module: the stage (this replica's copy).
        make_optimizer: the spec's ``(parameters) -> optimizer``.
        replica, replicas: this replica and the stage's replica count (>= 2).

    Raises:
        ValueError: for fewer than 2 replicas or fewer parameter tensors than replicas.
    """

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        *,
        replica: int,
        replicas: int,
    ) -> None:
        if replicas < 2:
            raise ValueError(
                f"a sharded optimizer needs at least 2 replicas per stage, got {replicas}"
            )
        self.params = list(module.parameters())
        self.owner = partition([p.numel() for p in self.params], replicas)
        self.replica, self.replicas = replica, replicas
        self.ward = (replica - 1) % replicas
        """The replica whose shard this one mirrors."""
        self.holder = (replica + 1) % replicas
        """The replica that mirrors this one's shard."""
        self.owned = OwnedParams(self.owned_by(replica))
        self.optimizer = make_optimizer(self.owned.parameters())
        self.mirror = OwnedParams(
            nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            for p in self.owned_by(self.ward)
        )
        self.mirror_optimizer = make_optimizer(self.mirror.parameters())
        self.synced = False
        """Whether every parameter holds its owner's current value (after `sync`)."""

    def owned_by(self, replica: int) -> list[nn.Parameter]:
        return [p for p, o in zip(self.params, self.owner, strict=True) if o == replica]

    def step_mirror(self) -> None:
        """At commit, after this replica's own step: apply the same update to the mirror,
        from the same (all-reduced) gradients the ward used."""
        for copy, source in zip(self.mirror.parameters(), self.owned_by(self.ward), strict=True):
            copy.grad = None if source.grad is None else source.grad.detach().clone()
        self.mirror_optimizer.step()
        self.mirror_optimizer.zero_grad(set_to_none=True)
        self.synced = False

    def sync(self, comm: StageComm | None) -> None:
        """Every parameter from its owner, over the stage group (one broadcast per owner
        and dtype). A no-op when already synced."""
        if self.synced:
            return
        assert comm is not None, "a sharded optimizer needs the stage group"
        with torch.no_grad():
            for owner in range(self.replicas):
                params = self.owned_by(owner)
                for dtype in sorted({p.dtype for p in params}, key=str):
                    group = [p for p in params if p.dtype == dtype]
                    flat = torch.cat([p.detach().reshape(-1) for p in group])
                    comm.broadcast_stage(flat, owner)
                    if owner != self.replica:
                        offset = 0
                        for p in group:
                            p.copy_(flat[offset : offset + p.numel()].view_as(p))
                            offset += p.numel()
        self.synced = True

    def state_bytes(self) -> tuple[int, int]:
        """``(own optimizer state, mirror: parameters + optimizer state)`` in bytes."""

        def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
            return sum(
                v.numel() * v.element_size()
                for entry in opt.state.values()
                for v in entry.values()
                if isinstance(v, torch.Tensor)
            )

        mirror = sum(p.numel() * p.element_size() for p in self.mirror.parameters())
        return optimizer_bytes(self.optimizer), mirror + optimizer_bytes(self.mirror_optimizer)
