"""The worker's side of moving state between workers over the current generation's groups.

`StateTransfer` is the part of `recovery.worker.StageWorker` that the plan's transfers
(`recovery.runtime.executor`) call: a whole-state copy from a live replica, the ZeRO-1
shard and its mirror (see `parallelism/zero.py`), and the CheckFree(+) rebuild of a lost
stage from its neighbours. The bytes move by `recovery.transport` (`SameHostTransport`,
which falls back to the process group by itself); the rebuild's math is
`recovery.strategies.checkfree`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallelism.buffers import persistent_buffers
from parallelism.engine import StageEngine
from parallelism.zero import OwnedParams
from recovery.errors import TransferCorrupted
from recovery.state import Progress, Rebuild, WorkerState
from recovery.strategies.checkfree import CheckFreeConfig, load_optimizer_moments, rebuild_stage
from recovery.transport import ProcessGroupTransport, SameHostTransport, recv_named, send_named
from recovery.worker.lifecycle import WorkerLifecycle

__all__ = ["Corruption", "StateTransfer"]

Corruption = dict[int, list[str]]
"""What a receive found corrupted (see [Note: checked transfers] in
recovery/transport/process_group.py): source rank -> the tensors whose bytes differ from
the sender's digests; empty: intact."""


class StateTransfer(WorkerLifecycle):
    """Sending and receiving the stage's state: copies, ZeRO-1 shards, CheckFree rebuilds.

    Owns no state of its own: it reads and rewrites the worker's state (module, optimizer
    and progress: see [Note: one worker state]), its engine, and the ZeRO-1 shard's mirror.
    Every receive checks what arrived against the sender's digests and reports a
    corruption (`Corruption`) instead of trusting it.
    """

    def _transport(self) -> SameHostTransport:
        """How this worker's whole states travel: copied out of the sender's memory between
        two workers on one host, over the process group otherwise (the transport falls back
        by itself; see [Note: same-host transfer])."""
        assert self.comm is not None
        return SameHostTransport(self.comm)

    def _take_flip(self) -> int | None:
        """The injected in-flight bit flip for this send, if one is armed (it fires once)."""
        flip, self.flip_in_flight = self.flip_in_flight, None
        return flip

    # -- whole-state copies --------------------------------------------------------------

    def send_state(self, dsts: list[int]) -> int:
        """Send this worker's whole state to each rank in ``dsts``, in turn. Returns bytes sent."""
        assert self.comm is not None
        ahead, self.digests_ahead = self.digests_ahead, None
        state = self.own_state()
        transport = self._transport()
        return sum(transport.send(dst, state, flip=self._take_flip(), ahead=ahead) for dst in dsts)

    def recv_state(self, src: int) -> tuple[int, int, Corruption]:
        """Become a copy of rank ``src``'s whole state (a rebuilt stage's mark included: see
        [Note: one worker state]). Returns ``(step, bytes received, what arrived
        corrupted)``; on a corruption this worker holds nothing trustworthy."""
        assert self.comm is not None
        self.digests_ahead = None  # written behind torch's back (see [Note: digests taken ahead])
        try:
            self.progress, received = self._transport().recv(src, self.own_state())
        except TransferCorrupted as exc:
            return self.step, 0, _corruption(exc)
        return self.step, received, {}

    # -- ZeRO-1 shards (see parallelism/zero.py) -----------------------------------------

    def _shard_state(self, params: nn.Module, optimizer: torch.optim.Optimizer) -> WorkerState:
        """A shard's parameters and optimizer with this stage's persistent buffers: what a
        replacement takes from its shard's mirror (the buffers, equal on every replica
        after each commit, are not in any shard)."""
        return WorkerState(
            OwnedParams(params.parameters(), buffers=persistent_buffers(self.module)),
            optimizer,
            self.progress,
        )

    def sync_params(self) -> None:
        """Every parameter from its owner (ZeRO-1; a collective over the stage group)."""
        if self.zero is not None:
            self.digests_ahead = None
            self.zero.sync(self.comm)

    def send_mirror(self, dst: int) -> int:
        """Send the mirror of the ward's shard to ``dst``, the ward's replacement. Returns bytes."""
        assert self.comm is not None and self.zero is not None
        zero = self.zero
        state = self._shard_state(zero.mirror, zero.mirror_optimizer)
        return self._transport().send(dst, state, flip=self._take_flip())

    def recv_shard(self, src: int) -> tuple[int, int, Corruption]:
        """Take this worker's own shard from its holder's mirror. Returns ``(step, bytes,
        what arrived corrupted)``."""
        assert self.comm is not None and self.zero is not None
        self.zero.synced = False
        self.digests_ahead = None
        try:
            state = self._shard_state(self.zero.owned, self.optimizer)
            self.progress, received = self._transport().recv(src, state)
        except TransferCorrupted as exc:
            return self.step, 0, _corruption(exc)
        return self.step, received, {}

    def seed_mirror(self, send: bool = True, receive: bool = True) -> int:
        """Send this worker's shard to its holder (``send``) and take a fresh mirror of its
        ward's (``receive``): after a recovery the holders' copies may be gone or from
        before a rollback. Returns bytes sent."""
        assert self.comm is not None and self.zero is not None
        zero = self.zero
        holder = self.topology.rank(self.stage, zero.holder)
        ward = self.topology.rank(self.stage, zero.ward)
        sent = 0
        if send:
            own = WorkerState(zero.owned, self.optimizer, self.progress)
            # Posted, not awaited, so that this worker receives meanwhile: over the process
            # group (a same-host copy needs its sender to wait for the receiver's answer).
            sent = ProcessGroupTransport(self.comm).send(holder, own, wait=False)
        if receive:
            self._transport().recv(
                ward, WorkerState(zero.mirror, zero.mirror_optimizer, self.progress)
            )
        self.comm.wait_sends()
        return sent

    # -- CheckFree(+) rebuilds -----------------------------------------------------------

    def send_named_state(self, dst: int, moments: bool) -> int:
        """Send this stage's weights (and optimizer moments) to a rebuilt neighbour. Returns bytes."""
        assert self.comm is not None
        return send_named(self.comm, dst, self.module, self.optimizer, moments=moments)

    def rebuild(
        self,
        strategy: str,
        sources: dict[str, int],
        norms: tuple[float | None, float | None],
        config: CheckFreeConfig,
        step: int,
    ) -> tuple[int, Corruption]:
        """CheckFree(+): rebuild this (lost) stage from its neighbours' states.

        ``sources`` maps ``"prev"`` / ``"next"`` to the ranks of live workers of stages
        ``stage-1`` / ``stage+1`` (``edge_copy`` needs only the swap partner). The weights
        come from `recovery.strategies.checkfree.rebuild_stage` -- the same function the
        in-process simulator calls -- over this worker's fresh module as the template.
        Returns the bytes received and what arrived corrupted (then nothing is rebuilt).
        """
        assert self.comm is not None
        received: dict[str, tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]] = {}
        total = 0
        corrupted: Corruption = {}
        for role in ("prev", "next"):
            if role in sources:
                try:
                    state, opt, nbytes = recv_named(self.comm, sources[role])
                except TransferCorrupted as exc:
                    corrupted.update(_corruption(exc))
                    continue
                received[role] = (state, opt)
                total += nbytes
        if corrupted:
            return total, corrupted
        template = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        prev = received.get("prev", (None, None))
        nxt = received.get("next", (None, None))
        result = rebuild_stage(
            config,
            stage=self.stage,
            num_stages=self.topology.stages,
            template=template,
            prev=prev[0],
            nxt=nxt[0],
            prev_norm=norms[0],
            next_norm=norms[1],
            edge_replicas=self.spec is not None and self.spec.routes == "swapped",
            exact_keys=self.shared_names,
            prev_moments=prev[1],
            next_moments=nxt[1],
        )
        self.module.load_state_dict(result.state)
        self.optimizer = self._make_optimizer()
        load_optimizer_moments(self.module, self.optimizer, result.moments)
        self.engine.release()
        self.engine = StageEngine(
            self.module,
            stage=self.stage,
            replica=self.replica,
            topology=self.topology,
            loss_fn=self.engine.loss_fn,
            device=self.device,
            clip_grad_norm=self.engine.clip_grad_norm,
            shared=self.shared_names,
            shared_is_home=self.engine.shared_is_home,
            progress=self.engine.progress,
            compute=self.rng.compute,
        )
        self.progress = Progress(step=step, rebuild=Rebuild.of(config, step))
        return total, {}


def _corruption(exc: TransferCorrupted) -> Corruption:
    return {source: list(tensors) for _, source, tensors in exc.found}
