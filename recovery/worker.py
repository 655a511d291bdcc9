"""The worker: one pipeline stage of one replica, run as a Ray actor.

`StageWorker` is a plain class (the controller wraps it with ``ray.remote``; tests may call
it directly). It holds the stage's module and optimizer, joins and leaves generations,
runs the stage's share of each step, and applies a step only when told to commit.

[Note: two-phase step]
A step runs in two phases. ``run_step(step)`` runs the microbatch schedule and the
gradient all-reduce and reports "ready" with the loss and gradient norm; nothing is applied.
Only when every live worker is ready does the controller call ``commit(step)``, and each
worker then applies its optimizer step. A failure before the commit abandons the step
everywhere (gradients are dropped), and after recovery the same step is run again on the
same data -- ``batches`` is a pure function of the step -- so no committed step is lost and
none is applied twice. A worker's step counter is the number of steps it has committed; it
is also its data cursor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from parallelism.comm import Rendezvous, StageComm, device_for
from parallelism.engine import StageEngine, StepStats
from parallelism.schedule import Schedule, build_schedule, forward_only, swapped_routes
from parallelism.seeding import seed_everything
from parallelism.topology import Topology
from parallelism.zero import ZeroShard
from recovery.checkpoint import load_checkpoint, save_checkpoint
from recovery.faults import Corrupt, Fault, Kill, KillPoint, WorkerFault
from recovery.snapshots import (
    DurableStore,
    PackedState,
    PeerSnapshots,
    WriteHandle,
    pack_state,
    unpack_state,
)
from recovery.spec import BatchFn, TrainSpec, apply_lr_schedule
from recovery.strategies.checkfree import CheckFreeConfig, load_optimizer_moments, rebuild_stage
from recovery.transfer import recv_named, recv_state, send_named, send_state

log = logging.getLogger("checkfree")

# Substrings by which a backend error reveals a dead or departed peer, as opposed to a
# bug in user code (which must stop the job, not trigger recovery).
_COMM_ERROR_MARKERS = (
    "gloo",
    "nccl",
    "connection",
    "timed out",
    "timeout",
    "process group used after close",
    "broken pipe",
)


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure (a peer died) rather than a user error."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, RuntimeError | ConnectionError | OSError) and any(
        marker in text for marker in _COMM_ERROR_MARKERS
    )


_STEP_POINTS = (KillPoint.BEFORE_FORWARD, KillPoint.MID_PIPELINE, KillPoint.DURING_ALLREDUCE)
"""The kill points inside phase one (`Worker.run_step`)."""


@dataclass
class StepReport:
    """A worker's answer to ``run_step``: ready (``ok``) with its measurements, or failed."""

    rank: int
    step: int
    ok: bool
    stats: StepStats = field(default_factory=StepStats)
    error: str = ""
    """For a failed step: the communication error the worker saw."""
    snapshots: dict[int, list[int]] = field(default_factory=dict)
    """Peer snapshots held: rank -> steps (its own rank: its own copies)."""
    durable_done: list[int] = field(default_factory=list)
    """Durable snapshot steps whose write finished since the last report."""


@dataclass(frozen=True)
class WorkerInfo:
    """Where a worker process runs."""

    pid: int
    node_id: str
    host: str


class StageWorker:
    """One stage of one pipeline replica. See [Note: two-phase step].

    Args:
        threads: intra-op threads for torch (set explicitly: several workers share a node).
    """

    def __init__(self, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.spec: TrainSpec | None = None
        self.comm: StageComm | None = None
        self.generation = -1
        self.step = 0
        self._faults: list[WorkerFault] = []
        self._activity = ("idle", time.time())
        self.peer = PeerSnapshots(keep=2)
        self._durable: DurableStore | None = None
        self._writes: dict[int, WriteHandle] = {}
        self._exchange: threading.Thread | None = None
        self.buddy: int | None = None
        self.ward: int | None = None

    # -- identity ------------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        """This worker's process id, Ray node and node address (127.0.0.1 outside Ray)."""
        import ray

        if not ray.is_initialized():
            return WorkerInfo(pid=os.getpid(), node_id="", host="127.0.0.1")
        node_id = ray.get_runtime_context().get_node_id()
        return WorkerInfo(pid=os.getpid(), node_id=node_id, host=ray.util.get_node_ip_address())

    # -- lifecycle -----------------------------------------------------------------------

    def setup(self, spec: TrainSpec, topology: Topology, rank: int, backend: str) -> float:
        """Build the stage module and optimizer at their initial state. Returns seconds taken."""
        start = time.perf_counter()
        self.spec = spec
        self.topology = topology
        self.rank = rank
        coords = topology.worker(rank)
        self.stage, self.replica = coords.stage, coords.replica
        self.backend = backend
        self.device = device_for(backend)
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
        )
        self._start_fresh()
        return time.perf_counter() - start

    def _start_fresh(self) -> None:
        """A newly set-up worker's progress: step 0, never rebuilt, no snapshots held."""
        self.rebuilt_at: int | None = None
        self.checkfree: CheckFreeConfig | None = None
        self.step = 0
        self.peer = PeerSnapshots(keep=2)

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
    ) -> float:
        """Form this generation's process groups. Returns seconds taken.

        ``buddy`` holds this worker's peer snapshots and this worker holds ``ward``'s; they
        travel over a side group (``side_group``) beside the training step.
        """
        start = time.perf_counter()
        self.leave()
        self.comm = StageComm(
            rendezvous,
            self.topology,
            self.rank,
            self.backend,
            bind_host,
            side_group=side_group,
            tied=self._tied_ranks(),
        )
        self.generation = generation
        self.buddy, self.ward = buddy, ward
        if self.zero is not None:
            self.zero.synced = False  # a new member may hold nothing current: sync everyone
        return time.perf_counter() - start

    def leave(self) -> None:
        """Tear down the current generation's process groups (idempotent)."""
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self._join_exchange()

    def reset(self) -> None:
        """Drop the job: process groups, module, optimizer. The process stays warm for reuse."""
        self.leave()
        if self._durable is not None:
            self._durable.close()
            self._durable = None
        self._writes = {}
        self.peer = PeerSnapshots(keep=2)
        self.spec = None
        for name in ("module", "optimizer", "engine"):
            self.__dict__.pop(name, None)
        self.generation = -1
        self.step = 0

    # -- the two phases ------------------------------------------------------------------

    def run_step(self, step: int, faults: tuple[Fault, ...] = ()) -> StepReport:
        """Phase one: forward, backward and gradient all-reduce of ``step``; apply nothing.

        ``faults`` are injected failures to fire at their points of this step or its commit.
        Returns a failed report (and tears down this generation) on a communication error.

        Raises:
            RuntimeError: if ``step`` is not this worker's next step.
            Exception: whatever user code raised (model, loss, data), after tearing down.
        """
        self._begin_step(step, faults)
        assert self.spec is not None
        seed_everything(self.spec.seed, "step", self.stage, self.replica, step)
        inputs, targets = self._data(self.spec.batches, step, self.schedule)
        try:
            if self.zero is not None:
                self.zero.sync(self.comm)
            stats = self.engine.run(self.schedule, self.comm, inputs, targets, self._hook)
        except Exception as exc:
            return self._failed(step, exc)
        finally:
            self._activity = ("idle", time.time())
        return self._report(step, stats)

    def commit(self, step: int) -> int:
        """Phase two: apply ``step``'s optimizer update. Returns the new step counter.

        Raises:
            RuntimeError: if ``step`` is not the step this worker just ran.
        """
        assert self.spec is not None, "setup() first"
        if step != self.step:
            raise RuntimeError(f"worker {self.rank} is at step {self.step}, asked to commit {step}")
        self._hook(KillPoint.BEFORE_COMMIT.value)
        self._apply(step)
        self.step = step + 1
        self._hook(KillPoint.AFTER_COMMIT.value)
        self._faults = []
        return self.step

    def _begin_step(self, step: int, faults: tuple[Fault, ...]) -> None:
        """Phase one's preamble: check the step, arm its faults, drop any leftover step.

        Raises:
            RuntimeError: if ``step`` is not this worker's next step.
        """
        assert self.spec is not None, "setup() first"
        if step != self.step:
            raise RuntimeError(
                f"worker {self.rank} is at step {self.step}, asked to run step {step}"
            )
        self._faults = [f for f in faults if isinstance(f, WorkerFault) and f.step == step]
        self._activity = ("step", time.time())
        self._drop_step()

    def _apply(self, step: int) -> None:
        """The commit's work: the optimizer update of ``step`` (and of a ZeRO-1 mirror)."""
        assert self.spec is not None
        factor = 1.0
        if self.rebuilt_at is not None and self.checkfree is not None:
            factor = self.checkfree.lr_factor(max(0, step - self.rebuilt_at))
        apply_lr_schedule(self.optimizer, self.spec.lr_schedule, step, self.base_lrs, factor=factor)
        self.optimizer.step()
        if self.zero is not None:
            mirror = self.zero.mirror_optimizer
            apply_lr_schedule(mirror, self.spec.lr_schedule, step, self.base_lrs, factor=factor)
            self.zero.step_mirror()
        self.module.zero_grad(set_to_none=True)

    def abandon(self, step: int) -> None:
        """Drop the uncommitted gradients of ``step`` (it will be run again)."""
        self._drop_step()

    def evaluate(self, index: int) -> StepReport:
        """Forward-only pass over held-out batch ``index``; losses reported by last stages."""
        assert self.spec is not None and self.spec.val_batches is not None
        inputs, targets = self._data(self.spec.val_batches, index, self.eval_schedule)
        try:
            if self.zero is not None:
                self.zero.sync(self.comm)
            stats = self.engine.run(self.eval_schedule, self.comm, inputs, targets)
        except Exception as exc:
            return self._failed(self.step, exc)
        return StepReport(rank=self.rank, step=self.step, ok=True, stats=stats)

    # -- state ---------------------------------------------------------------------------

    def state(self) -> dict[str, object]:
        """The worker's full state, on CPU: weights, optimizer state and step."""
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "step": self.step,
        }

    # -- helpers -------------------------------------------------------------------------

    def _data(
        self, fn: BatchFn, index: int, schedule: Schedule
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        assert self.spec is not None
        ends = {schedule.first_stage(m) for m in range(schedule.num_microbatches)}
        ends |= {schedule.last_stage(m) for m in range(schedule.num_microbatches)}
        if self.stage not in ends:  # a middle stage never touches data
            return [], []
        batch = fn(index, self.replica, self.topology.replicas)
        return self.spec.split(batch, step=index, replica=self.replica)

    def _drop_step(self) -> None:
        """Forget everything of the uncommitted step (its gradients)."""
        self.module.zero_grad(set_to_none=True)

    def _failed(self, step: int, exc: Exception) -> StepReport:
        if is_comm_error(exc):
            # Another worker failed first and the step was aborted before this one's own
            # injected kill struck: the failures injected into one step strike together,
            # so it dies now instead of in the retried step.
            for fault in self._faults:
                if isinstance(fault, Kill) and fault.at in _STEP_POINTS:
                    self._hook(fault.at.value)
        # Tear down first so that peers blocked on us fail fast (see parallelism/comm.py).
        self.leave()
        self._drop_step()
        if not is_comm_error(exc):
            raise exc
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return StepReport(rank=self.rank, step=step, ok=False, error=detail)

    def _hook(self, point: str) -> None:
        """Called at named points inside a step: fires the injected faults armed for it."""
        for fault in self._faults:
            if fault.at.value != point:
                continue
            self._record_fault_time()
            if isinstance(fault, Corrupt):
                with torch.no_grad():  # a flipped bit: nothing fails, the numbers go bad
                    next(self.module.parameters()).view(-1)[0] = float("nan")
                continue
            if isinstance(fault, Kill):
                self._die()
            self._activity = ("hung", time.time())
            self._hang()

    def _die(self) -> None:
        """An injected kill: a real death, no cleanup, no goodbye (overridden by workers
        that run as threads, see recovery/runtime/thread_group.py)."""
        os.kill(os.getpid(), signal.SIGKILL)

    def _hang(self) -> None:
        """An injected hang: the process lives on and does nothing until it is killed."""
        threading.Event().wait()

    def _record_fault_time(self) -> None:
        """Leave the wall-clock time of an injected fault in the store, for detection timing."""
        if self.comm is not None:
            with contextlib.suppress(Exception):
                self.comm.store.set(f"fault/{self.rank}", repr(time.time()))

    # -- recovery ------------------------------------------------------------------------

    def probe(self) -> dict[str, object]:
        """What the worker is doing right now (answered from a separate thread).

        ``waiting_on`` is the peer rank a communication call is blocked on, if any: a worker
        blocked on a peer is a victim of a hang, not its cause.
        """
        kind, since = self._activity
        waiting = self.comm.waiting_on if self.comm is not None else None
        return {"activity": kind, "since": since, "waiting_on": waiting, "step": self.step}

    def abort(self) -> None:
        """Abandon the running step from outside it: tear down this generation's groups.

        Called from a control thread while ``run_step`` may be running: its next (or
        current) communication fails, and peers blocked on this worker wake up.
        """
        comm = self.comm
        if comm is not None:
            comm.close()

    def prepare_recovery(self) -> StepReport:
        """Abandon the uncommitted step and leave the generation.

        Returns the committed step and what redundancy this worker holds (peer snapshots,
        finished durable writes), for the planner.
        """
        self._drop_step()
        self._faults = []
        self.leave()
        return self.flush_snapshots()  # let durable writes in flight land before anyone prunes

    # -- snapshots (see recovery/snapshots.py) --------------------------------------------

    def _report(self, step: int, stats: StepStats) -> StepReport:
        done = []
        for s in sorted(s for s, h in self._writes.items() if h.done()):
            try:
                self._writes.pop(s).result()
                done.append(s)
            except Exception as exc:  # that snapshot never completes; training goes on
                log.warning("durable snapshot of step %d failed on rank %d: %s", s, self.rank, exc)
        holdings = {rank: sorted(steps) for rank, steps in self.peer.holdings().items()}
        return StepReport(
            rank=self.rank, step=step, ok=True, stats=stats, snapshots=holdings, durable_done=done
        )

    def flush_snapshots(self) -> StepReport:
        """Wait for durable writes in flight; report what is held (at the end of a job)."""
        if self._durable is not None:
            for handle in list(self._writes.values()):
                with contextlib.suppress(Exception):
                    self._durable.wait(handle)
        self._join_exchange()
        return self._report(self.step, StepStats())

    def take_snapshot(self, step: int) -> float:
        """Keep a packed copy of this worker's state at ``step`` and send one to the buddy.

        The copy is taken now (so the next step cannot leak into it); the exchange with
        buddy and ward runs on a background thread over the side group, overlapped with
        training. Returns the seconds the caller was blocked.
        """
        start = time.perf_counter()
        assert step == self.step, (step, self.step)
        self._join_exchange()
        packed = pack_state(self.module, self.optimizer, step)
        self.peer.put(step, self.rank, packed)
        comm, buddy, ward = self.comm, self.buddy, self.ward
        if comm is not None and buddy is not None and ward is not None and buddy != self.rank:
            self._exchange = threading.Thread(
                target=self._swap_snapshots,
                args=(comm, step, packed, buddy, ward),
                name="peer-snapshot",
                daemon=True,
            )
            self._exchange.start()
        return time.perf_counter() - start

    def _swap_snapshots(
        self, comm: StageComm, step: int, packed: PackedState, buddy: int, ward: int
    ) -> None:
        header = torch.frombuffer(bytearray(packed.header()), dtype=torch.uint8)
        sizes = torch.tensor([header.numel(), packed.nbytes], dtype=torch.int64)
        try:
            works = comm.side_isend([sizes, header, packed.data], buddy)
            theirs = comm.side_recv(torch.empty(2, dtype=torch.int64), ward)
            their_header = comm.side_recv(torch.empty(int(theirs[0]), dtype=torch.uint8), ward)
            data = comm.side_recv(torch.empty(int(theirs[1]), dtype=torch.uint8), ward)
            comm.side_wait(works)
            self.peer.put(step, ward, PackedState.from_parts(their_header.numpy().tobytes(), data))
        except Exception:  # the generation ended under us: the snapshot is simply incomplete
            return

    def _join_exchange(self) -> None:
        if self._exchange is not None:
            self._exchange.join(timeout=60.0)
            self._exchange = None

    def restore_own(self, step: int) -> int:
        """Roll back to this worker's own peer snapshot of ``step``. Returns the step."""
        self.step = unpack_state(self.peer.get(step, self.rank), self.module, self.optimizer)
        self._rolled_back(step)
        return self.step

    def send_snapshot(self, step: int, ward: int, dst: int) -> int:
        """Send the held snapshot of ``ward`` at ``step`` to ``dst`` (its replacement). Returns bytes."""
        assert self.comm is not None
        packed = self.peer.get(step, ward)
        header = torch.frombuffer(bytearray(packed.header()), dtype=torch.uint8)
        sizes = torch.tensor([header.numel(), packed.nbytes], dtype=torch.int64)
        for t in (sizes, header, packed.data):
            self.comm.isend(t.to(self.comm.device), dst)
        self.comm.wait_sends()
        return int(header.numel() + packed.nbytes)

    def recv_snapshot(self, step: int, src: int) -> int:
        """Restore the snapshot of ``step`` that ``src`` holds for this rank. Returns the step."""
        assert self.comm is not None
        sizes = self.comm.recv(
            torch.empty(2, dtype=torch.int64, device=self.comm.device), src
        ).cpu()
        header = self.comm.recv(
            torch.empty(int(sizes[0]), dtype=torch.uint8, device=self.comm.device), src
        )
        data = self.comm.recv(
            torch.empty(int(sizes[1]), dtype=torch.uint8, device=self.comm.device), src
        )
        packed = PackedState.from_parts(header.cpu().numpy().tobytes(), data.cpu())
        self.step = unpack_state(packed, self.module, self.optimizer)
        self._rolled_back(step)
        self.peer.put(step, self.rank, packed)
        return self.step

    def durable_write(self, root: str, step: int) -> float:
        """Start writing this worker's state at ``step`` to the durable tier (asynchronously).

        Its completion shows in a later report's ``durable_done``. Returns seconds blocked.
        """
        start = time.perf_counter()
        assert step == self.step, (step, self.step)
        if self._durable is None or str(self._durable.root) != str(root):
            self._durable = DurableStore(root)
        self._writes[step] = self._durable.write(step, self.rank, self.module, self.optimizer)
        return time.perf_counter() - start

    def durable_load(self, root: str, step: int) -> int:
        """Load this worker's durable snapshot of ``step``. Returns the step.

        Raises:
            SnapshotCorrupted: if its files do not match their checksums (nothing loaded).
        """
        if self._durable is not None:
            self._durable.close()
        self._writes = {}
        self._durable = DurableStore(root)
        self.step = self._durable.load(step, self.rank, self.module, self.optimizer)
        self._rolled_back(step)
        return self.step

    def _rolled_back(self, step: int) -> None:
        """After restoring the state of ``step``: forget everything newer (another timeline)."""
        self.peer.discard_after(step)
        if self.rebuilt_at is not None and self.rebuilt_at > step:
            self.rebuilt_at = self.checkfree = None

    def send_state(self, dsts: list[int]) -> int:
        """Send this worker's state to each rank in ``dsts``, in turn. Returns bytes sent."""
        assert self.comm is not None
        extra = {"rebuilt_at": self.rebuilt_at, "checkfree": self.checkfree}
        return sum(
            send_state(self.comm, dst, self.module, self.optimizer, self.step, extra)
            for dst in dsts
        )

    def recv_state(self, src: int) -> tuple[int, int]:
        """Become a copy of rank ``src``'s state. Returns ``(step, bytes received)``."""
        assert self.comm is not None
        self.step, received, extra = recv_state(self.comm, src, self.module, self.optimizer)
        # A copy of a rebuilt stage keeps its learning-rate scale, or the replicas diverge.
        self.rebuilt_at, self.checkfree = extra.get("rebuilt_at"), extra.get("checkfree")
        return self.step, received

    # -- ZeRO-1 shards (see parallelism/zero.py) -----------------------------------------

    def sync_params(self) -> None:
        """Every parameter from its owner (ZeRO-1; a collective over the stage group)."""
        if self.zero is not None:
            self.zero.sync(self.comm)

    def send_mirror(self, dst: int) -> int:
        """Send the mirror of the ward's shard to ``dst``, the ward's replacement. Returns bytes."""
        assert self.comm is not None and self.zero is not None
        zero = self.zero
        return send_state(self.comm, dst, zero.mirror, zero.mirror_optimizer, self.step)

    def recv_shard(self, src: int) -> tuple[int, int]:
        """Take this worker's own shard from its holder's mirror. Returns ``(step, bytes)``."""
        assert self.comm is not None and self.zero is not None
        self.step, received, _ = recv_state(self.comm, src, self.zero.owned, self.optimizer)
        self.zero.synced = False
        return self.step, received

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
            sent = send_state(self.comm, holder, zero.owned, self.optimizer, self.step, wait=False)
        if receive:
            recv_state(self.comm, ward, zero.mirror, zero.mirror_optimizer)
        self.comm.wait_sends()
        return sent

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
    ) -> int:
        """CheckFree(+): rebuild this (lost) stage from its neighbours' states.

        ``sources`` maps ``"prev"`` / ``"next"`` to the ranks of live workers of stages
        ``stage-1`` / ``stage+1`` (``edge_copy`` needs only the swap partner). The weights
        come from `recovery.strategies.checkfree.rebuild_stage` -- the same function the
        in-process simulator calls -- over this worker's fresh module as the template.
        Returns the bytes received.
        """
        assert self.comm is not None
        received: dict[str, tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]] = {}
        total = 0
        for role in ("prev", "next"):
            if role in sources:
                state, opt, nbytes = recv_named(self.comm, sources[role])
                received[role] = (state, opt)
                total += nbytes
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
        )
        self.step = step
        self.rebuilt_at = step
        self.checkfree = config
        return total

    def warm(self, spec: TrainSpec, topology: Topology, backend: str) -> float:
        """Pay a worker's one-time costs ahead of need (a hot spare): build a stage, run an
        optimizer step, form a one-worker process group. Returns seconds taken."""
        start = time.perf_counter()
        self.setup(spec, topology, 0, backend)
        inputs, _ = spec.split(spec.batches(0, 0, topology.replicas), step=0, replica=0)
        out = self.module(inputs[0].to(self.device))  # autograd's first use is slow too
        out.float().sum().backward()
        self.optimizer.step()
        self.reset()
        return time.perf_counter() - start

    def save_checkpoint(self, root: str, step: int) -> float:
        """Write this worker's state to a checkpoint (the ``restart`` baseline). Returns seconds."""
        start = time.perf_counter()
        assert step == self.step, (step, self.step)
        save_checkpoint(root, self.rank, self.module, self.optimizer, self.step)
        return time.perf_counter() - start

    def load_checkpoint(self, root: str, step: int) -> int:
        """Load this worker's checkpoint of ``step``. Returns the step."""
        self.step = load_checkpoint(root, self.rank, step, self.module, self.optimizer)
        return self.step


def _to_cpu(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
