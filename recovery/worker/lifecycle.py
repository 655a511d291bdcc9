"""A worker's life and the state every part of it reads.

`WorkerLifecycle` is the base of `recovery.worker.StageWorker`: it builds the stage for a
job (`setup`), forms and tears down each generation's process groups (`join`, `leave`),
drops the job while the process stays warm (`reset`, `warm`), and says where it runs and
what it holds (`info`, `state`). The other parts of the worker -- the two-phase step,
snapshots, state transfers -- read and write the state it owns.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import torch

from parallelism.comm import CommError, Rendezvous, StageComm
from parallelism.devices import compute_device, deterministic_cuda
from parallelism.engine import StageEngine, drop_kept_buffers
from parallelism.schedule import build_schedule, forward_only, swapped_routes
from parallelism.seeding import Randomness
from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from parallelism.zero import ZeroShard
from recovery.state import Progress, WorkerState
from recovery.transport import DigestsAhead
from recovery.worker.callbacks import guard_callbacks
from recovery.worker.keeper import SnapshotKeeper
from recovery.worker.memory import keep_freed_memory, release_freed_memory
from recovery.worker.reports import WorkerInfo

__all__ = ["WorkerLifecycle"]

_EXCHANGE_AFTER_CLOSE_S = 2.0
"""How long leaving a generation waits for a peer-snapshot exchange its groups' teardown
did not end (one blocked on a peer that is gone)."""


class WorkerLifecycle:
    """Setup, generations, reset and warm-up of one worker.

    Owns the job's spec and topology, this worker's coordinates, the stage's module,
    optimizer, schedules and engine (and its ZeRO-1 shard), the current generation's
    process groups (``comm``) with its buddy and ward, its ``progress`` (the step, and a
    CheckFree rebuild's mark: see [Note: one worker state]) and the snapshots held
    (``snapshots``, a `SnapshotKeeper`).

    Args:
        threads: intra-op threads for torch (set explicitly: several workers share a node).
    """

    def __init__(self, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        keep_freed_memory()  # see [Note: a worker keeps its freed memory]
        self.spec: TrainSpec | None = None
        self.comm: StageComm | None = None
        self.forming: threading.Event | None = None
        """Set by `abort` to give up the generation being formed (see
        [Note: abandoning a formation] in parallelism/comm/groups.py)."""
        self.abandoned: dict[str, int] = {}
        """Per job (`WorkerGroup.job`), the newest generation `abort` gave up: a ``join`` of
        it (or an older one) that starts after the abort gives up at once. Kept across
        jobs (the last few): an abort can reach a parked worker after its job ended."""
        self.job = ""
        """The job of the generation this worker last began to join."""
        self.joining = -1
        """The generation this worker last began to join."""
        self.generation = -1
        self.progress = Progress()
        """This worker's progress: the step it is at and a rebuild's mark (see [Note: one
        worker state] in recovery/state.py)."""
        self.rng: Randomness = Randomness()
        """The random streams its steps seed and draw from (a thread worker's are its own)."""
        self.snapshots = SnapshotKeeper()
        self.buddy: int | None = None
        self.ward: int | None = None
        self.shares: tuple[int, ...] | None = None
        """In a shrunk generation, the replicas whose microbatches this worker computes
        (see [Note: elastic shrink] in recovery/runtime/elastic.py); None: its own only."""
        self.flip_in_flight: int | None = None
        """An injected `recovery.faults.BitFlip` with ``in_flight``: the seed of the bit
        to flip in the next state this worker sends (see [Note: checked transfers])."""
        self.digests_ahead: DigestsAhead | None = None
        """The digests of this worker's state, taken after a failure in case it is asked
        for it (see [Note: digests taken ahead] in recovery/transport/process_group.py)."""
        self.slowdown = 1.0
        """An injected `recovery.faults.Slow`: each forward and backward pass takes this
        many times its own time (1: not slowed). Set up afresh, a worker is not slowed."""

    # -- state ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps committed: the next step to run, and the data cursor."""
        return self.progress.step

    @step.setter
    def step(self, step: int) -> None:
        self.progress = self.progress.at(step)

    def own_state(self) -> WorkerState:
        """This worker's whole state, by reference (see [Note: one worker state])."""
        return WorkerState(self.module, self.optimizer, self.progress)

    # -- identity ------------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        """This worker's process id, Ray node and node address (127.0.0.1 outside Ray)."""
        import ray

        if not ray.is_initialized():
            return WorkerInfo(pid=os.getpid(), node_id="", host="127.0.0.1")
        node_id = ray.get_runtime_context().get_node_id()
        return WorkerInfo(pid=os.getpid(), node_id=node_id, host=ray.util.get_node_ip_address())

    # -- lifecycle -----------------------------------------------------------------------

    def setup(
        self,
        spec: TrainSpec,
        topology: Topology,
        rank: int,
        backend: str,
        device: str | None = None,
    ) -> float:
        """Build the stage module and optimizer at their initial state. Returns seconds taken.

        ``device``: what the user asked to compute on (`parallelism.devices`; None: the
        backend's own). On CUDA the worker's algorithms are made deterministic first, before
        its first CUDA work (`parallelism.devices.deterministic_cuda`).

        Raises:
            ValueError: for a device this worker cannot compute on (no GPU visible).
        """
        start = time.perf_counter()
        self.slowdown = 1.0
        self.topology = topology
        self.rank = rank
        coords = topology.worker(rank)
        self.stage, self.replica = coords.stage, coords.replica
        self.spec = spec = guard_callbacks(spec, self)
        self.backend = backend
        self.device = compute_device(backend, device)
        self.device_choice = device
        if self.device.type == "cuda":
            deterministic_cuda()
        self.module = spec.build(self.stage, topology.stages).to(self.device)
        shared = spec.shared_params(self.stage, topology.stages) if spec.shared_params else []
        self.shared_names = list(shared)
        self.zero: ZeroShard | None = None
        if spec.shard_optimizer:
            self.zero = ZeroShard(
                self.module, spec.make_optimizer, replica=self.replica, replicas=topology.replicas
            )
        self.optimizer = self.zero.optimizer if self.zero else self._make_optimizer()
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        routes = None
        if spec.routes == "swapped":
            routes = swapped_routes(topology.stages, spec.microbatches)
        self.schedule = build_schedule(spec.schedule, topology.stages, spec.microbatches, routes)
        self.eval_schedule = forward_only(topology.stages, spec.microbatches)
        self.engine = StageEngine(
            self.module,
            stage=self.stage,
            replica=self.replica,
            topology=topology,
            loss_fn=spec.loss_fn,
            device=self.device,
            clip_grad_norm=spec.clip_grad_norm,
            shared=self.shared_names,
            shared_is_home=self.stage in (0, topology.stages - 1),
            compute=self._compute,
        )
        self._start_fresh()
        return time.perf_counter() - start

    @contextlib.contextmanager
    def _compute(self) -> Iterator[None]:
        """A forward or backward pass (its random streams in force); under an injected
        `Slow`, followed by a sleep of ``slowdown - 1`` times its time -- inside the time the
        engine measures as compute, after the streams (a thread worker's lock) are given
        back, so that it slows this worker only."""
        start = time.perf_counter()
        with self.rng.compute():
            yield
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - start))

    def _start_fresh(self) -> None:
        """A newly set-up worker's progress: step 0, never rebuilt, no snapshots held."""
        self.progress = Progress()
        self.snapshots.forget_peers()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """The spec's optimizer; shared (CheckFree+ replica) parameters in a group of their own."""
        assert self.spec is not None
        if not self.shared_names:
            return self.spec.make_optimizer(self.module.parameters())
        named = list(self.module.named_parameters())
        shared = set(self.shared_names)
        groups = [
            {"params": [p for n, p in named if n not in shared], "shared": False},
            {"params": [p for n, p in named if n in shared], "shared": True},
        ]
        return self.spec.make_optimizer(groups)  # type: ignore[arg-type]

    def _tied_ranks(self) -> tuple[int, ...]:
        """Every holder of this stage's shared parameters: both stages of its CheckFree+ pair."""
        if not self.shared_names:
            return ()
        last = self.topology.stages - 1
        partner = {0: 1, 1: 0, last - 1: last, last: last - 1}[self.stage]
        return tuple(
            sorted(
                self.topology.rank(s, r)
                for s in (self.stage, partner)
                for r in range(self.topology.replicas)
            )
        )

    def join(
        self,
        generation: int,
        rendezvous: Rendezvous,
        bind_host: str,
        side_group: bool = False,
        buddy: int | None = None,
        ward: int | None = None,
        members: tuple[int, ...] | None = None,
        shares: tuple[int, ...] | None = None,
    ) -> float:
        """Form this generation's process groups. Returns seconds taken.

        ``buddy`` holds this worker's peer snapshots and this worker holds ``ward``'s; they
        travel over a side group (``side_group``) beside the training step. A shrunk job's
        generation (see [Note: elastic shrink] in recovery/runtime/elastic.py) names its
        ``members`` and, per worker, the replicas whose microbatches it computes
        (``shares``, own first; empty: it only applies the averaged update); None: all.
        """
        start = time.perf_counter()
        self.leave()
        self.shares = shares
        self.joining, self.job = generation, rendezvous.job
        self.forming = threading.Event()
        if generation <= self.abandoned.get(rendezvous.job, -1):  # the abort came first
            raise CommError(
                f"gloo group formation abandoned: generation {generation} was given up "
                "before this worker began to join it"
            )
        self.comm = StageComm(
            rendezvous,
            self.topology,
            self.rank,
            self.backend,
            bind_host,
            side_group=side_group,
            tied=self._tied_ranks(),
            device=self.device,
            members=members,
            cancel=self.forming,
        )
        self.generation = generation
        self.buddy, self.ward = buddy, ward
        if self.zero is not None:
            self.zero.synced = False  # a new member may hold nothing current: sync everyone
        return time.perf_counter() - start

    def leave(self) -> None:
        """Tear down the current generation's process groups (idempotent).

        A peer-snapshot exchange still in flight fails with them -- or, waiting on a peer
        that is gone, is given up after a moment: leaving never waits on a peer (a live
        worker that kept its controller waiting here would be taken for lost).
        """
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self.snapshots.join_exchange(timeout=_EXCHANGE_AFTER_CLOSE_S)

    def reset(self, release: bool = True) -> None:
        """Drop the job: process groups, module, optimizer. The process stays warm for reuse.

        ``release``: give the freed memory back to the kernel (a worker parked for another
        job); a spare's warm-up keeps it for the state it will receive (see [Note: a worker
        keeps its freed memory] in recovery/worker/memory.py).
        """
        self.leave()
        self.snapshots.close()
        self.spec = None
        for name in ("module", "optimizer", "engine"):
            self.__dict__.pop(name, None)
        self.generation = self.joining = -1  # the next job counts afresh
        self.progress = Progress()
        if release:
            drop_kept_buffers()
            release_freed_memory()

    def warm(
        self, spec: TrainSpec, topology: Topology, backend: str, device: str | None = None
    ) -> float:
        """Pay a worker's one-time costs ahead of need (a hot spare): build a stage, run an
        optimizer step. The memory they touched stays with the process, for the state a
        replacement receives, and so does the stage's flat gradient buffer (see [Note: a
        kept gradient buffer] in parallelism/engine.py). Returns seconds taken."""
        start = time.perf_counter()
        self.setup(spec, topology, 0, backend, device)
        inputs, _ = spec.split(spec.batches(0, 0, topology.replicas), step=0, replica=0)
        out = self.module(inputs[0].to(self.device))  # autograd's first use is slow too
        out.float().sum().backward()
        self.optimizer.step()
        self.engine.keep_buffer()
        self.reset(release=False)
        return time.perf_counter() - start

    def state(self) -> dict[str, object]:
        """The worker's whole state, copied to the CPU: ``{"model", "optimizer",
        "progress"}`` (`WorkerState.to_cpu`)."""
        return self.own_state().to_cpu()
