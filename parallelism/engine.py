"""Runs one pipeline stage's share of a training step: its schedule, then the gradient all-reduce.

`StageEngine` executes the actions a `Schedule` lists for one stage -- receive, forward,
send, backward -- on the stage's module, then averages the stage's gradients (and the
buffer values the step computed, see [Note: buffers are state] in parallelism/buffers.py)
across the replicas of the stage and measures (and optionally clips) the gradient's norm.
It never steps the optimizer nor writes the buffers: applying a step is the caller's
decision (the two-phase step, see
[Note: two-phase step] in ``recovery/worker/stage.py``). It knows nothing of failures: a
communication error simply propagates.

[Note: overlapped all-reduce]
With replicas to average with, the stage's gradients are copied into one flat buffer as
backward makes them (see `StageEngine._bind_gradients`), cut into buckets from its end --
the last parameters' come first out of backward -- a small first one
(``FIRST_BUCKET_BYTES``), then ``BUCKET_BYTES`` each, as DDP does. During the step's last backward (earlier microbatches
only accumulate), a hook on every parameter counts its bucket's final gradients, and a
complete bucket's all-reduce starts at once, so the reduction runs while backward goes on
and while the stage still sends its input gradients. Buckets start strictly in bucket
order, so every replica issues the same collectives in the same order whatever order its
hooks fire in; buckets whose parameters the step did not use start after the schedule. The
sums are per element, so the bits are those of one all-reduce over the buffer for two
replicas; with three or more, Gloo's ring sums an element in an order that depends on its
place in the message, so the bits depend on the (fixed) bucket layout, the same in every
run and every replacement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallelism.buffers import StageBuffers
from parallelism.comm import Activation, StageComm, Waitable
from parallelism.progress import Progress, progress_for
from parallelism.schedule import Op, Schedule
from parallelism.topology import Topology

# Points inside a step at which a caller-supplied hook runs (failure injection uses them).
BEFORE_FORWARD = "before_forward"
MID_PIPELINE = "mid_pipeline"
DURING_ALLREDUCE = "during_allreduce"

Hook = Callable[[str], None]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

FIRST_BUCKET_BYTES = 1 << 20
"""The first gradient bucket (the last parameters, whose gradients backward makes first) is
small, so that its all-reduce starts early, as DDP's is."""
BUCKET_BYTES = 4 << 20
"""The other buckets. Gloo's throughput on one host hardly grows past a few MB a message."""


@dataclass
class StepStats:
    """What one stage measured during one step."""

    loss_sum: float = 0.0
    """Sum of the (unscaled) losses of the microbatches this stage ended."""
    losses: int = 0
    """How many microbatch losses this stage computed (0 unless it ended some route)."""
    grad_norm: float = 0.0
    """L2 norm of the stage's whole gradient after the all-reduce, before clipping."""
    clipped_grad_norm: float = 0.0
    """The same norm after clipping (equal to ``grad_norm`` without clipping)."""
    compute_s: float = 0.0
    """Seconds spent in forward and backward computation."""
    schedule_s: float = 0.0
    """Wall seconds from the first to the last action of the schedule (sends waited)."""
    allreduce_s: float = 0.0
    """Wall seconds of the gradient all-reduce."""
    timeline: list[tuple[str, float, float]] = field(default_factory=list)
    """(action, start, end) per compute action, seconds since the step began."""

    @property
    def finite(self) -> bool:
        """Whether the loss (if any was computed here) and the gradient norm are finite:
        a step may be committed only if every worker's are."""
        return math.isfinite(self.grad_norm) and (not self.losses or math.isfinite(self.loss_sum))


def call_stage(
    module: nn.Module, x: Activation, *, first: bool, last: bool, natural: bool
) -> Activation:
    """Call a stage module, telling it its route position only when that is not its usual one.

    Plain user modules take one tensor (a tuple of tensors is passed as that many
    arguments: what a stage split by ``torch.distributed.pipelining`` takes when several
    values cross the split); a module that can stand in for the first or last stage
    (CheckFree+) accepts ``first=`` / ``last=`` keywords.
    """
    args = x if isinstance(x, tuple) else (x,)
    if natural:
        return module(*args)
    return module(*args, first=first, last=last)


def _needs_grad(value: Activation) -> list[torch.Tensor]:
    """The tensors of an activation that take part in the backward pass."""
    tensors = value if isinstance(value, tuple) else (value,)
    return [t for t in tensors if t.requires_grad]


class StageEngine:
    """Executes one stage's schedule for one replica.

    Args:
        module: the stage's module (already on ``device``).
        stage, replica: this worker's coordinates in ``topology``.
        loss_fn: ``(output, targets) -> scalar`` on the last stage of a route.
        clip_grad_norm: clip the stage's gradient to this L2 norm after the all-reduce
            (per stage, as CheckFree's bookkeeping expects), or ``None``.
        progress: what measures this stage's progress; default `progress_for` ``device``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        replica: int,
        topology: Topology,
        loss_fn: LossFn,
        device: torch.device,
        clip_grad_norm: float | None = None,
        shared: Sequence[str] = (),
        shared_is_home: bool = True,
        progress: Progress | None = None,
        compute: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.module = module
        self.compute = compute
        """Entered around every forward and backward action: where the worker's random
        streams are in force (`parallelism.seeding.Randomness.compute`)."""
        self.stage = stage
        self.replica = replica
        self.topology = topology
        self.loss_fn = loss_fn
        self.device = device
        self.progress = progress if progress is not None else progress_for(device)
        """Marked at every schedule action and around the all-reduce; what hang detection
        measures a stall from (`progressed_at`). On a GPU a mark counts once its CUDA work
        has completed (parallelism/progress.py)."""
        self.clip_grad_norm = clip_grad_norm
        shared_names = set(shared)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        unknown = shared_names - {n for n, _ in named}
        if unknown:
            raise ValueError(
                f"shared parameters {sorted(unknown)} are not parameters of stage {stage}"
            )
        self.params = [p for n, p in named if n not in shared_names]
        """The stage's own parameters (averaged over its replicas)."""
        self.shared = [p for n, p in named if n in shared_names]
        """Parameters held bit-identically by another stage too: their gradient is summed
        over every holder (see `StageComm.allreduce_tied`) and clipped as a group."""
        self.shared_is_home = shared_is_home
        self._grad_flat: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        """Parameter index -> its bucket."""
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._overlap: _Overlap | None = None
        """Set while the step's last backward runs: the buckets its hooks launch."""
        self.buffers = StageBuffers(module, topology.replicas)
        """The stage's buffers: a training step's values wait for the commit, averaged
        over the replicas (see [Note: buffers are state] in parallelism/buffers.py)."""

    def _bind_gradients(self) -> None:
        """Make sure the flat gradient buffer exists and drop every own parameter's
        ``.grad``, so that the step's backward makes fresh gradients (autograd hands the
        first one over without a copy); each is then copied into its slice of the buffer
        (`_place`), where the all-reduce runs on it in place, and the parameter's ``.grad``
        becomes that slice. One copy per gradient, where zeroing the buffer and letting
        backward add into it costs a zeroing pass and a read more; the values are those of
        separate ``.grad`` tensors either way, so training is unchanged to the bit. Only with
        replicas to average with, and one dtype and device, as ``_flatten_dense_tensors``
        needs too."""
        if self.topology.replicas < 2 or not self.params:
            return
        if self._grad_flat is None:
            first = self.params[0]
            if any(p.dtype != first.dtype or p.device != first.device for p in self.params):
                return
            total = sum(p.numel() for p in self.params)
            # Not zeroed: every slice is written (`_place`) before an all-reduce reads it.
            self._grad_flat = _flat_buffer(total, first.dtype, first.device)
            offset = 0
            for p in self.params:
                self._grad_views.append(self._grad_flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self._make_buckets()
        for p in self.params:
            p.grad = None

    def _place(self, index: int) -> None:
        """Put own parameter ``index``'s gradient into its slice of the flat buffer (a zero
        if it has none) and make the slice its ``.grad``."""
        param, view = self.params[index], self._grad_views[index]
        grad = param.grad
        if grad is not None and grad.data_ptr() == view.data_ptr():
            return
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        param.grad = view

    def _make_buckets(self) -> None:
        """Cut the flat buffer into buckets, from its end (backward's order), and hook every
        own parameter so that the step's last backward can launch a bucket's all-reduce as
        soon as all of its gradients are final (see [Note: overlapped all-reduce])."""
        assert self._grad_flat is not None
        size = self._grad_flat.element_size()
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        cap, end = FIRST_BUCKET_BYTES, len(self.params)
        for start in range(len(self.params) - 1, -1, -1):
            if (offsets[end] - offsets[start]) * size >= cap or start == 0:
                index = len(self._buckets)
                members = range(start, end)
                self._buckets.append(
                    _Bucket(self._grad_flat[offsets[start] : offsets[end]], members)
                )
                for j in members:
                    self._bucket_of[j] = index
                end, cap = start, BUCKET_BYTES
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._on_grad, i)))

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        """A parameter's gradient is final for this backward: launch every bucket that is now
        complete, in bucket order (every replica issues the same all-reduces in the same
        order, whatever order its hooks fire in)."""
        overlap = self._overlap
        if overlap is None:
            return
        self._place(index)
        overlap.ready[self._bucket_of[index]] += 1
        overlap.launch(self._buckets)

    @property
    def progressed_at(self) -> float:
        """When this stage last made progress, on the monotonic clock: what hang detection
        measures a stall from, so that a long healthy step is not a hang and a stuck one is
        seen from its last progress."""
        return self.progress.at()

    def release(self) -> None:
        """Remove this engine's gradient hooks (before another engine takes the module)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def keep_buffer(self) -> None:
        """Make this engine's flat gradient buffer if it has none, and leave it to the next
        engine this process makes for a stage of as many gradient elements (a hot spare's
        warm-up, for the stage it then takes over: see [Note: a kept gradient buffer]). The engine is done
        with after this: its hooks are removed."""
        self._bind_gradients()
        if self._grad_flat is not None:
            self._grad_flat.zero_()  # its pages, faulted in here, not in the next first step
            _KEPT.append(self._grad_flat)
            self._grad_flat, self._grad_views, self._buckets = None, [], []
            self._bucket_of = {}
        self.release()

    def _bound(self) -> bool:
        """Whether backward left every own gradient in the flat buffer (nothing replaced one)."""
        return self._grad_flat is not None and all(
            p.grad is not None and p.grad.data_ptr() == view.data_ptr()
            for p, view in zip(self.params, self._grad_views, strict=True)
        )

    def _rank(self, stage: int) -> int:
        return self.topology.rank(stage, self.replica)

    def run(
        self,
        schedule: Schedule,
        comm: StageComm | None,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        hook: Hook | None = None,
    ) -> StepStats:
        """Run the schedule's actions for this stage, then reduce gradients (if it trains).

        ``inputs[m]`` / ``targets[m]`` are microbatch ``m``'s data; only the stages that
        start (end) a route read them. Gradients accumulate into ``.grad``; on return they
        hold the replica-averaged gradient of the mean loss over the global batch.

        Raises:
            RuntimeError: on a communication error (a peer died), from the backend.
        """
        stats = StepStats()
        hook = hook or (lambda point: None)
        training = schedule.has_backward()
        if training:
            self.buffers.begin()
        self._run_schedule(schedule, comm, inputs, targets, hook, stats, overlap=True)
        if training:
            self.buffers.collect()
            self._reduce(comm, hook, stats)
        return stats

    def run_shares(
        self,
        schedule: Schedule,
        comm: StageComm | None,
        shares: Sequence[Share],
        hook: Hook | None = None,
    ) -> StepStats:
        """A training step of a shrunk job (see [Note: elastic shrink] in
        recovery/runtime/elastic.py): run the schedule once per share -- this pipeline's own
        microbatches, then those of each missing pipeline it stands in for -- keeping each
        share's gradients apart, then add them in share order and all-reduce the sum with
        the stage's other members. No share at all (a live worker of an incomplete
        pipeline) contributes zero and still applies the same averaged update. The average is
        over the job's full replica count, so the step is the failure-free step: bit for bit
        with two replicas (a sum of two is the same in either order, and adding a zero
        changes nothing); with more, the order of the additions differs from the ring's.

        Raises:
            RuntimeError: on a communication error (a peer died), from the backend.
        """
        stats = StepStats()
        hook = hook or (lambda point: None)
        total: list[torch.Tensor] | None = None
        self.buffers.begin()
        for index, share in enumerate(shares):
            inputs, targets = share.prepare()
            self._run_schedule(
                schedule,
                comm,
                inputs,
                targets,
                hook if index == 0 else (lambda point: None),
                stats,
                overlap=False,
            )
            self.buffers.collect()  # each share starts from the committed buffers
            grads = [
                p.grad if p.grad is not None else torch.zeros_like(p)
                for p in (*self.params, *self.shared)
            ]
            if total is None:
                total = [g.clone() for g in grads]
            else:
                for t, g in zip(total, grads, strict=True):
                    t.add_(g)
            for p in (*self.params, *self.shared):
                p.grad = None  # the next share starts from zero
        self._bind_gradients()
        if total is not None:  # else no share: a zero contribution
            for p, t in zip((*self.params, *self.shared), total, strict=True):
                if p.grad is None:
                    p.grad = t
                else:
                    p.grad.copy_(t)
        self._reduce(comm, hook, stats)
        return stats

    def _reduce(self, comm: StageComm | None, hook: Hook, stats: StepStats) -> None:
        start = time.perf_counter()
        self.progress.mark()
        self._reduce_gradients(comm, hook, stats)
        self.progress.mark()
        stats.allreduce_s = time.perf_counter() - start

    def _run_schedule(
        self,
        schedule: Schedule,
        comm: StageComm | None,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        hook: Hook,
        stats: StepStats,
        *,
        overlap: bool,
    ) -> None:
        """The schedule's actions for this stage; gradients accumulate into ``.grad`` (with
        replicas, fresh ones, placed in the flat buffer by the last backward's hooks), bucket
        all-reduces launched from the last backward when ``overlap`` (see [Note: overlapped
        all-reduce])."""
        self.progress.mark()
        actions = schedule.for_stage(self.stage)
        num_mb = schedule.num_microbatches
        training = schedule.has_backward()
        received: dict[int, Activation] = {}
        stage_in: dict[int, Activation] = {}
        stage_out: dict[int, Activation] = {}
        grad_out: dict[int, list[torch.Tensor]] = {}
        t0 = time.perf_counter()
        hook(BEFORE_FORWARD)
        mid = len(actions) // 2
        last_backward = max((i for i, a in enumerate(actions) if a.op is Op.BACKWARD), default=-1)
        self._overlap = None
        if training:
            self._bind_gradients()
        context = torch.enable_grad() if training else torch.no_grad()
        with context:
            for index, action in enumerate(actions):
                self.progress.mark()
                if index == mid:
                    hook(MID_PIPELINE)
                m = action.microbatch
                if action.op is Op.RECV_F:
                    assert comm is not None and action.peer is not None
                    received[m] = comm.recv_activation(self._rank(action.peer))
                elif action.op is Op.FORWARD:
                    start = time.perf_counter()
                    first = schedule.first_stage(m) == self.stage
                    last = schedule.last_stage(m) == self.stage
                    natural = first == (self.stage == 0) and last == (
                        self.stage == self.topology.stages - 1
                    )
                    # A received activation requires a gradient where the sender's did.
                    x = inputs[m].to(self.device, non_blocking=True) if first else received.pop(m)
                    with self.compute():
                        self.progress.mark()  # (a thread worker may have waited for another)
                        out = call_stage(self.module, x, first=first, last=last, natural=natural)
                        if last:
                            if not isinstance(out, torch.Tensor):
                                raise ValueError(
                                    f"the last stage must return one tensor (the loss "
                                    f"function's input), got {type(out).__name__}"
                                )
                            target = targets[m].to(self.device, non_blocking=True)
                            loss = self.loss_fn(out, target)
                            stats.loss_sum += float(loss.detach())
                            stats.losses += 1
                            out = loss / num_mb
                    stage_in[m], stage_out[m] = x, out
                    end = time.perf_counter()
                    stats.compute_s += end - start
                    stats.timeline.append((str(action), start - t0, end - t0))
                elif action.op is Op.SEND_F:
                    assert comm is not None and action.peer is not None
                    comm.send_activation(stage_out[m], self._rank(action.peer))
                    if not training:
                        stage_out.pop(m)
                        stage_in.pop(m)
                elif action.op is Op.RECV_B:
                    assert comm is not None and action.peer is not None
                    grad_out[m] = [
                        comm.recv(
                            torch.empty(like.shape, dtype=like.dtype, device=self.device),
                            self._rank(action.peer),
                        )
                        for like in _needs_grad(stage_out[m])
                    ]
                elif action.op is Op.BACKWARD:
                    start = time.perf_counter()
                    if overlap and index == last_backward and self._buckets and comm is not None:
                        self._overlap = _Overlap(comm, [0] * len(self._buckets))
                    out = stage_out.pop(m)
                    with self.compute():
                        self.progress.mark()
                        if m in grad_out:
                            torch.autograd.backward(_needs_grad(out), grad_out.pop(m))
                        else:
                            assert isinstance(out, torch.Tensor)  # the loss
                            out.backward()
                    end = time.perf_counter()
                    stats.compute_s += end - start
                    stats.timeline.append((str(action), start - t0, end - t0))
                elif action.op is Op.SEND_B:
                    assert comm is not None and action.peer is not None
                    # The receiver knows the shapes (its own output's), so no header; an
                    # input the stage did not use gets a zero gradient.
                    for x in _needs_grad(stage_in.pop(m)):
                        grad = x.grad if x.grad is not None else torch.zeros_like(x)
                        comm.isend(grad, self._rank(action.peer))
                if action.op is Op.BACKWARD and schedule.first_stage(m) == self.stage:
                    stage_in.pop(m, None)
            if comm is not None:
                comm.wait_sends()
        stats.schedule_s += time.perf_counter() - t0

    def _reduce_gradients(self, comm: StageComm | None, hook: Hook, stats: StepStats) -> None:
        if self._grad_flat is not None:  # the gradients no hook placed (none, without overlap)
            for index in range(len(self.params)):
                self._place(index)
        for p in (*self.params, *self.shared):
            if p.grad is None:  # a parameter unused this step still takes part in the reduction
                p.grad = torch.zeros_like(p)
        replicas = self.topology.replicas
        own = [p.grad for p in self.params if p.grad is not None]
        works: list[tuple[Waitable | None, torch.Tensor, list[torch.Tensor]]] = []
        overlap, self._overlap = self._overlap, None
        if replicas > 1 and own:
            assert comm is not None
            if overlap is not None:  # buckets, some launched during backward; launch the rest
                overlap.launch(self._buckets, everything=True)
                works.extend(
                    (w, b.flat, []) for w, b in zip(overlap.works, self._buckets, strict=True)
                )
            elif self._bound():  # reduced in place: the gradients are views of the buffer
                assert self._grad_flat is not None
                works.append((comm.allreduce_stage(self._grad_flat), self._grad_flat, []))
            else:
                flat = _flatten_dense_tensors(own)
                works.append((comm.allreduce_stage(flat), flat, own))
        if self.shared:
            # Sum over both holders of every replica, then average over replicas: each holder
            # gets the same bits (an all-reduce leaves identical results on every rank).
            assert comm is not None
            tied = [p.grad for p in self.shared if p.grad is not None]
            flat_tied = _flatten_dense_tensors(tied)
            works.append((comm.allreduce_tied(flat_tied), flat_tied, tied))
        # The buffers' sum goes after every gradient bucket, in the same order everywhere.
        buffers = self.buffers.reduce(comm if replicas > 1 else None)
        hook(DURING_ALLREDUCE)
        # With buckets, each one's gradients are averaged and their norms taken as soon as
        # its all-reduce is back, while the later ones are still on the wire.
        norms: dict[int, torch.Tensor] | None = {} if overlap is not None else None
        for k, (work, flat, grads) in enumerate(works):
            if work is not None:
                comm.wait(work)  # type: ignore[union-attr]
            if replicas > 1:
                flat.div_(replicas)
            if grads:
                for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                    grad.copy_(reduced)
            if norms is not None and k < len(self._buckets):
                for i in self._buckets[k].params:
                    norms[i] = torch.linalg.vector_norm(self._grad_views[i], 2.0)
        self.buffers.finish(comm, buffers)
        own_norms = [norms[i] for i in range(len(self.params))] if norms is not None else None
        norm, clipped = clip_gradients(
            self.params,
            self.clip_grad_norm,
            self.shared,
            shared_is_home=self.shared_is_home,
            norms=own_norms,
        )
        stats.grad_norm, stats.clipped_grad_norm = norm, clipped


_KEPT: list[torch.Tensor] = []
"""Flat gradient buffers left by `StageEngine.keep_buffer` for this process's next engine.

[Note: a kept gradient buffer]
A stage's flat gradient buffer is one allocation of its whole gradient. On a thread other
than the main one -- where a Ray actor runs its calls -- glibc serves a block larger than
one of the thread's 64 MiB heaps with a fresh ``mmap``, whatever malloc's settings
(recovery/worker/memory.py), and a fresh mapping faults in on first touch: a replacement's
first step after a warm-spare recovery of the 100 MB 1x2 job (bench.py peers) took
~26,700 page faults (its 104 MB buffer's pages), all in its backward, where its gradients
are copied into the new buffer. So a hot spare's warm-up makes the buffer once, touches
it, and keeps it (`StageEngine.keep_buffer`), and the engine of the stage it takes over
takes it if the size matches (any stage of a pure data-parallel job, a spare's own stage
else); a worker parked for another job drops it (`drop_kept_buffers`).
"""


def drop_kept_buffers() -> None:
    """Give up the kept flat gradient buffers (see [Note: a kept gradient buffer])."""
    _KEPT.clear()


def _flat_buffer(total: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised flat gradient buffer: a kept one of this size, else a new one
    (and the kept ones, for another stage, are dropped: they serve the next engine only)."""
    for i, kept in enumerate(_KEPT):
        if kept.numel() == total and kept.dtype == dtype and kept.device == device:
            return _KEPT.pop(i)
    _KEPT.clear()
    return torch.empty(total, dtype=dtype, device=device)


@dataclass
class Share:
    """One pipeline replica's microbatches in a shrunk step (`StageEngine.run_shares`)."""

    replica: int
    prepare: Callable[[], tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]
    """Seeds the random generators as that replica's own worker does for this step, then
    returns its microbatches' inputs and targets (called just before its schedule runs)."""


@dataclass
class _Bucket:
    flat: torch.Tensor
    """A slice of the flat gradient buffer: the gradients of consecutive parameters."""
    params: range
    """The indices of those parameters (in `StageEngine.params`)."""

    @property
    def members(self) -> int:
        """How many parameters' gradients it holds."""
        return len(self.params)


@dataclass
class _Overlap:
    """The all-reduces one step's last backward launches (see [Note: overlapped all-reduce])."""

    comm: StageComm
    ready: list[int]
    """Per bucket, how many of its gradients are final."""
    works: list[Waitable | None] = field(default_factory=list)
    """The launched all-reduces, in bucket order."""

    def launch(self, buckets: Sequence[_Bucket], *, everything: bool = False) -> None:
        """Launch the next buckets in order while they are complete (all of them, with
        ``everything``: parameters the step did not use keep a zero gradient)."""
        while len(self.works) < len(buckets):
            bucket = buckets[len(self.works)]
            if not everything and self.ready[len(self.works)] < bucket.members:
                return
            self.works.append(self.comm.allreduce_stage(bucket.flat))


def _clip_group(
    params: Sequence[nn.Parameter],
    max_norm: float | None,
    norms: Sequence[torch.Tensor] | None = None,
) -> tuple[float, float]:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0, 0.0
    if norms is None:
        norm = float(torch.nn.utils.get_total_norm(grads))
    else:  # get_total_norm's arithmetic for gradients of one device and dtype
        norm = float(torch.linalg.vector_norm(torch.stack(list(norms)), 2.0))
    if max_norm is None or not math.isfinite(norm) or norm <= max_norm:
        return norm, norm
    torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    return norm, float(max_norm)


def clip_gradients(
    params: Sequence[nn.Parameter],
    max_norm: float | None,
    shared: Sequence[nn.Parameter] = (),
    *,
    shared_is_home: bool = True,
    norms: Sequence[torch.Tensor] | None = None,
) -> tuple[float, float]:
    """Clip a stage's gradient in place; return ``(norm before, recorded norm after)``.

    ``params`` are clipped to ``max_norm`` by their own norm, and ``shared`` -- parameters
    the stage holds a bit-identical replica of with another stage (CheckFree+) -- as a
    group of their own, so both holders scale them by the same factor. The recorded norm
    (what CheckFree's weights read) is that of ``params`` after clipping, combined with
    ``shared``'s on their home stage. Without ``max_norm`` nothing is scaled. The
    single-process reference and the convergence simulator call this too, so all compute
    the same arithmetic. ``norms``: the L2 norm of each of ``params``' gradients, already
    taken (all of one device and dtype, every one with a gradient), which gives the same
    bits as taking them here.
    """
    own_before, own_after = _clip_group(params, max_norm, norms)
    if not shared:
        return own_before, own_after
    shared_before, shared_after = _clip_group(shared, max_norm)
    after = math.hypot(own_after, shared_after) if shared_is_home else own_after
    return math.hypot(own_before, shared_before), after
