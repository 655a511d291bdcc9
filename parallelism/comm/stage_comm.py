"""The process groups one worker uses during one generation of a job.

A generation is one membership epoch: a fixed set of live workers with fresh process
groups formed on a fresh key prefix of the controller's store. `StageComm` builds the
groups of one worker -- the world group (point-to-point inside a pipeline, state
transfer between any two workers) and its stage group (gradient all-reduce across the
replicas of its stage), plus the commit vote's TCP tree (`parallelism.commit_vote`) -- and tears
them down with `close`. Process-group objects are
constructed directly rather than through ``torch.distributed.init_process_group`` so that
no global state survives a generation: closing one and forming the next is just dropping
objects, and a test can run several workers' groups in one process. How groups are built
and torn down is in parallelism/comm/groups.py, how their connections are cut in
parallelism/comm/gloo_sockets.py ([Note: tearing down on failure]). Whatever fails in a
method that talks to peers is raised as a `CommError` ([Note: communication errors are
marked at the source] in parallelism/errors.py).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from parallelism.comm.gloo_sockets import _socket_inodes, _Transport
from parallelism.comm.groups import (
    _REAPER,
    _SLICE_TIMEOUT,
    _WAIT_SLICE,
    _Group,
    _make_group,
    _Waiter,
    abort_groups,
    device_for,
)
from parallelism.comm.rendezvous import Rendezvous
from parallelism.comm.wire import (
    ACTIVATION_HEADER_LEN,
    MAX_TUPLE,
    Activation,
    ReceiveBudget,
    StagedWork,
    Waitable,
    empty_received,
    land,
    pack_activation_header,
    to_wire,
    unpack_activation_header,
    wire_buffer,
)
from parallelism.commit_vote import CommitVote
from parallelism.devices import wire_device
from parallelism.errors import CommError, talks
from parallelism.progress import Progress, progress_for
from parallelism.topology import Topology


class StageComm:
    """One worker's process groups for one generation.

    Args:
        rendezvous: the controller's store address and this generation's key prefix.
        topology: the job layout; ``rank`` is this worker's global rank in it.
        backend: ``gloo`` or ``nccl``.
        bind_host: the address this worker's transport listens on (its node's IP).
        device: the compute device (`parallelism.devices.compute_device`); default the
            backend's own (`device_for`). Tensors given to and received from this object
            are on it; the backend moves them on ``wire`` (`parallelism.devices.wire_device`),
            staged in between when the two differ ([Note: compute device and wire device]).
        members: the global ranks of this generation's workers (default: all of the
            topology's). A shrunk job's generation leaves out the workers it runs without
            (see [Note: elastic shrink] in recovery/runtime/elastic.py); every group is formed
            over the members only, and callers keep using global ranks.
        cancel: set (from another thread) to give up forming the groups at once, with a
            communication error (see [Note: abandoning a formation]).

    Raises:
        CommError: if the groups cannot be formed within ``rendezvous.timeout_s`` (a
            peer died or the formation was abandoned).
        ValueError: for NCCL with a compute device that is not CUDA.
    """

    @talks
    def __init__(
        self,
        rendezvous: Rendezvous,
        topology: Topology,
        rank: int,
        backend: str,
        bind_host: str,
        *,
        side_group: bool = False,
        tied: tuple[int, ...] = (),
        device: torch.device | None = None,
        members: tuple[int, ...] | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.topology = topology
        self.rank = rank
        self.members = tuple(sorted(members)) if members is not None else None
        if self.members is not None and rank not in self.members:
            raise ValueError(f"rank {rank} is not a member of this generation {self.members}")
        present = self.members if self.members is not None else range(topology.world_size)
        self._index = {r: i for i, r in enumerate(present)}
        """Global rank -> its rank in this generation's world (the same without a shrink)."""
        self.worker = topology.worker(rank)
        self.backend = backend
        self.device = device if device is not None else device_for(backend)
        """The compute device: where what is sent comes from and what is received goes."""
        self.wire = wire_device(backend, self.device)
        """Where the backend moves bytes (host memory for Gloo, the GPU for NCCL)."""
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        base = dist.TCPStore(rendezvous.host, rendezvous.port, None, False, timeout)
        collective = datetime.timedelta(
            seconds=rendezvous.collective_s
            if rendezvous.collective_s is not None
            else rendezvous.timeout_s
        )
        self._store: dist.Store | None = dist.PrefixStore(rendezvous.prefix, base)
        # Connected: from now on, dropping the generation's store fails our waits at once
        # (the controller waits for this key before it drops a formation that cannot finish).
        self._store.set(f"joined/{rank}", "1")
        before = _socket_inodes()
        world_store = dist.PrefixStore("world", self._store)

        def form(
            backend: str, store: dist.Store, rank: int, size: int, device: torch.device | None
        ) -> _Group:
            return _make_group(
                backend,
                store,
                rank,
                size,
                bind_host,
                collective,
                device,
                formation=timeout,
                cancel=cancel,
            )

        self._world: _Group | None = form(
            backend, world_store, self._index[rank], len(self._index), self.wire
        )
        self._stage: _Group | None = None
        stage_peers = [r for r in topology.stage_group(self.worker.stage) if r in self._index]
        if len(stage_peers) > 1:
            stage_store = dist.PrefixStore(f"stage{self.worker.stage}", self._store)
            self._stage = form(
                backend, stage_store, stage_peers.index(rank), len(stage_peers), self.wire
            )
        # The workers that hold bit-identical replicas of some parameters (CheckFree+'s
        # (de)embedding on stages 0 and 1, or S-2 and S-1), every replica of both stages.
        self._tied: _Group | None = None
        if tied:
            tied_store = dist.PrefixStore("tied" + "_".join(map(str, tied)), self._store)
            self._tied = form(backend, tied_store, tied.index(rank), len(tied), self.wire)
        # A second, always-Gloo world group for traffic that runs beside the step on another
        # thread (peer snapshots in host memory): it never competes with the step's ordering.
        self._side: _Group | None = None
        if side_group:
            side_store = dist.PrefixStore("side", self._store)
            self._side = form("gloo", side_store, self._index[rank], len(self._index), None)
        self._transport = (
            _Transport(before, self._store, rank, list(self._index))
            if backend == "gloo" or side_group
            else None
        )
        self._vote: CommitVote | None = None
        self._waiter: _Waiter | None = None
        self._collective_timeout = collective
        self._pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        self._blocked_on: int | None = None
        # NCCL's waits are queued on the GPU: what they wait for is known from events
        # (parallelism/progress.py); Gloo's block the calling thread.
        self._queued: Progress = progress_for(self.wire) if backend == "nccl" else Progress()
        # The commit vote's own sockets, formed last: every peer is past its Gloo groups.
        try:
            self._vote = CommitVote(
                dist.PrefixStore("vote", self._store),
                self._index[rank],
                len(self._index),
                bind_host,
                timeout,
                cancel,
                secret=rendezvous.secret,
            )
        except BaseException:
            self.close()
            raise

    @property
    def waiting_on(self) -> int | None:
        """The peer rank this worker is waiting for (-1: a collective), else None: the one a
        blocking call waits for, or under NCCL the one of the oldest wait queued on the GPU
        that has not completed (the CPU blocks on it later, in ``.item()``)."""
        blocked = self._blocked_on
        return blocked if blocked is not None else self._queued.waiting_on()

    @property
    def store(self) -> dist.Store:
        """This generation's view of the controller's store."""
        if self._store is None:
            raise CommError("process group used after close()")
        return self._store

    # -- point to point (global ranks) ---------------------------------------------------

    @property
    def world(self) -> _Group:
        if self._world is None:
            raise CommError("process group used after close()")
        return self._world

    @talks
    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to global rank ``dst`` without waiting; see `wait_sends`. A tensor
        off the wire device is sent from a wire copy (`to_wire`), finished before this
        returns, so the caller may change ``tensor`` at once."""
        tensor = to_wire(tensor, self.wire)
        self._pending.append((self.world.send([tensor], self._index[dst], 0), tensor, dst))

    @talks
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``tensor`` from global rank ``src``, blocking (on the wire first
        when ``tensor`` is off the wire device, then copied into it)."""
        landing = tensor if tensor.device == self.wire else wire_buffer(tensor, self.wire)
        self.wait(self.world.recv([landing], self._index[src], 0), src)
        return land(tensor, landing)

    @talks
    def recv_many(self, tensors: list[torch.Tensor], src: int) -> None:
        """Receive into each of ``tensors`` in order from ``src``, all receives posted at once."""
        landings = [t if t.device == self.wire else wire_buffer(t, self.wire) for t in tensors]
        works = [self.world.recv([t], self._index[src], 0) for t in landings]
        for work in works:
            self.wait(work, src)
        for tensor, landing in zip(tensors, landings, strict=True):
            land(tensor, landing)

    def _collective_on(self, tensor: torch.Tensor, start: Any) -> Waitable:
        """Start ``start([wire tensor])`` on ``tensor``, or on a wire copy of it that waiting
        copies back (`StagedWork`)."""
        if tensor.device == self.wire:
            return start([tensor])
        staged = to_wire(tensor, self.wire)
        return StagedWork(start([staged]), staged, tensor)

    @talks
    def wait(self, work: Waitable, peer: int = -1) -> None:
        """Wait for ``work``, noting whom we wait for (see `waiting_on`).

        Raises:
            CommError: the work's error, or `close` ran meanwhile.
        """
        self._blocked_on = peer
        try:
            if self.backend == "gloo" and peer == -1:
                self._wait_collective(work)
            elif self.backend == "gloo":
                self._wait_point_to_point(work)
            else:
                work.wait()  # NCCL: enqueues a stream wait, the CPU does not block
                self._queued.queued_wait(peer)
        finally:
            self._blocked_on = None

    def _wait_point_to_point(self, work: Waitable) -> None:
        """Block on a Gloo send or receive until it completes or this worker's groups are
        closed: cutting the connections wakes it, except in the race of `_wait_collective`,
        which sends and receives meet too under load (a transfer a dead peer will never
        finish then waits for Gloo's timeout). Their wait cannot be sliced -- Gloo would
        fail the transfer itself when a slice ran out -- so one waits on a helper thread
        (`_Waiter`) while this one checks, in slices, whether the groups were closed."""
        if work.is_completed():
            work.wait()  # its result, or its error
            return
        waiter = self._waiter  # (read once: `close` on another thread takes it)
        if waiter is None:
            waiter = self._waiter = _Waiter()
        try:
            given_up = not waiter.wait(work, lambda: self.closed)
        finally:
            if self.closed:  # (`close` may have run before this waiter existed)
                waiter.retire()
        if given_up:
            raise RuntimeError(
                "Connection closed: this worker's process groups were torn down while it "
                "waited on a peer"
            )

    def _wait_collective(self, work: Waitable) -> None:
        """Block on a Gloo collective until it completes or this worker's groups are closed.

        See [Note: tearing down on failure]: cutting the connections wakes a waiter, except
        in one race that the tests met under load (a collective queued on the group's
        worker thread while another thread closes the group; Gloo then leaves it pending
        until its own timeout, a minute). So a collective is waited on in short slices
        (re-waiting a Gloo collective after a slice runs out is safe) and given up as soon
        as the groups are closed. Not so a send or a receive: Gloo hands their timeout to
        the transfer itself, which then fails; they run on the calling thread and the cut
        connections always wake them.
        """
        while True:
            try:
                work.wait(_WAIT_SLICE)
                return
            except RuntimeError as exc:
                if _SLICE_TIMEOUT not in str(exc):
                    raise  # the work's own error (a dead peer, Gloo's timeout)
                if self.closed:
                    raise RuntimeError(
                        "Connection closed: this worker's process groups were torn down "
                        "while it waited"
                    ) from None

    @talks
    def wait_sends(self) -> None:
        """Wait until every `isend` so far has completed (their buffers may then be reused)."""
        pending, self._pending = self._pending, []
        for work, _, dst in pending:
            self.wait(work, dst)

    @talks
    def send_activation(self, value: Activation, dst: int) -> None:
        """Send an activation -- one tensor, or a tuple of tensors -- of any shapes and dtypes.

        Each tensor is preceded by a small metadata header (its shape, dtype, whether it
        requires a gradient, and how many tensors the tuple holds), so the receiver needs
        no prior knowledge: `recv_activation` reads the headers. Users never declare
        activation shapes. A tuple is what a stage split off a model by
        ``torch.distributed.pipelining`` passes on when several values cross the split
        (GPT-2 passes its hidden states and its attention mask).
        """
        tensors = value if isinstance(value, tuple) else (value,)
        if not 0 < len(tensors) <= MAX_TUPLE:
            raise ValueError(f"an activation is 1 to {MAX_TUPLE} tensors, got {len(tensors)}")
        for tensor in tensors:
            header = pack_activation_header(tensor, len(tensors) if isinstance(value, tuple) else 0)
            self.isend(header.to(self.wire), dst)
            self.isend(tensor.detach(), dst)

    @talks
    def recv_activation(self, src: int) -> Activation:
        """Receive an activation sent with `send_activation`.

        A received tensor requires a gradient exactly when the sent one did, so the
        backward pass sends gradients back for those and only those (`activation_grads`).
        """
        tensors: list[torch.Tensor] = []
        count = 1
        first_size: int | None = None
        budget = ReceiveBudget(self.device)  # one for the whole tuple
        while len(tensors) < count:
            empty = torch.empty(ACTIVATION_HEADER_LEN, dtype=torch.int64, device=self.wire)
            meta = self.recv(empty, src).tolist()
            shape, dtype, size, grad = unpack_activation_header(meta, first_size, src)
            first_size = size
            buffer = empty_received(
                shape, dtype, self.device, f"an activation header from rank {src}", budget
            )
            tensor = self.recv(buffer, src)
            tensors.append(tensor.requires_grad_(grad))
            count = max(1, int(size))
        return tuple(tensors) if int(size) else tensors[0]

    # -- the side group (host memory, another thread) ----------------------------------

    @talks
    def side_isend(self, tensors: list[torch.Tensor], dst: int) -> list[dist.Work]:
        """Start sending CPU ``tensors`` to ``dst`` over the side group; wait on the result."""
        if self._side is None:
            raise RuntimeError("no side group in this generation (closed, or not requested)")
        return [self._side.send([t.contiguous()], self._index[dst], 0) for t in tensors]

    @talks
    def side_recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into CPU ``tensor`` from ``src`` over the side group, blocking."""
        if self._side is None:
            raise RuntimeError("no side group in this generation (closed, or not requested)")
        self._side.recv([tensor], self._index[src], 0).wait()
        return tensor

    @talks
    def side_wait(self, works: list[dist.Work]) -> None:
        """Wait for `side_isend`'s works."""
        for work in works:
            work.wait()

    # -- collectives -----------------------------------------------------------------------

    @talks
    def allreduce_stage(self, tensor: torch.Tensor) -> Waitable | None:
        """Start a sum all-reduce of ``tensor`` across this stage's replicas (None if alone).

        Raises:
            CommError: if the groups were closed (never silently skip the reduction).
        """
        if self.closed:
            raise CommError("process group used after close()")
        if self._stage is None:
            return None
        return self._collective_on(tensor, self._stage.allreduce)

    @talks
    def broadcast_stage(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrite ``tensor`` with replica ``root``'s, across this stage's replicas; blocks.

        Raises:
            CommError: if the groups were closed, or a peer died.
        """
        if self.closed:
            raise CommError("process group used after close()")
        if self._stage is None:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        stage = self._stage
        self.wait(self._collective_on(tensor, lambda ts: stage.broadcast(ts, opts)))

    @talks
    def allreduce_tied(self, tensor: torch.Tensor) -> Waitable:
        """Start a sum all-reduce of ``tensor`` over the holders of this worker's tied parameters.

        Raises:
            CommError: if the groups were closed or this worker holds no tied parameters.
        """
        if self.closed or self._tied is None:
            raise RuntimeError("no tied group in this generation (closed, or nothing shared)")
        return self._collective_on(tensor, self._tied.allreduce)

    @talks
    def barrier(self) -> None:
        """Block until every worker of the generation reaches this point."""
        self.wait(self.world.allreduce([torch.zeros(1, device=self.wire)]))

    @talks
    def exchange(self, row: Sequence[float]) -> dict[int, tuple[float, ...]]:
        """Every worker's ``row`` (all of one length, float64 on the wire), by global rank;
        blocks. On the calling thread, over the generation's own TCP connections, not a
        process group: see [Note: the vote's own connections] in parallelism/commit_vote.py.

        Raises:
            CommError: a peer died, or the groups were closed (before or meanwhile).
        """
        vote = self._vote
        if vote is None:
            raise CommError("process group used after close()")
        self._blocked_on = -1
        try:
            rows = vote.allgather(row, self._collective_timeout)
        finally:
            self._blocked_on = None
        return {r: rows[i] for r, i in self._index.items()}

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Tear the groups down so that peers blocked on this worker fail fast.

        See [Note: tearing down on failure]. Safe to call more than once.
        """
        # A worker's step thread and its control thread may both close: take each part
        # once read, so the other's None never lands between a check and a use.
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.shut_down()
        vote, self._vote = self._vote, None
        if vote is not None:
            vote.shut_down()
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.retire()
        groups = [g for g in (self._world, self._stage, self._tied, self._side) if g is not None]
        self._pending = []
        self._world = None
        self._stage = None
        self._tied = None
        self._side = None
        self._store = None
        abort_groups(groups)
        _REAPER.bury(groups)  # see [Note: process groups die on a thread of their own]

    @property
    def closed(self) -> bool:
        return self._world is None
