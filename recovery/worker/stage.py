"""The worker: one pipeline stage of one replica, run as a Ray actor.

`StageWorker` is a plain class (the controller wraps it with ``ray.remote``; tests may call
it directly). It runs the stage's share of each step and applies a step only when told to
commit; this module holds that two-phase step, the injected faults that strike inside it,
and the calls that abandon it for a recovery. The rest of the worker is its bases: its
lifecycle and state (`recovery.worker.lifecycle`), its snapshots
(`recovery.worker.snapshots`) and its state transfers (`recovery.worker.transfers`).

[Note: two-phase step]
A step runs in two phases. ``run_step(step)`` runs the microbatch schedule and the
gradient all-reduce and reports "ready" with the loss and gradient norm; nothing is applied.
Only when every live worker is ready does the controller call ``commit(step)``, and each
worker then applies its optimizer step. A failure before the commit abandons the step
everywhere (gradients are dropped), and after recovery the same step is run again on the
same data -- ``batches`` is a pure function of the step -- so no committed step is lost and
none is applied twice. A worker's step counter is the number of steps it has committed; it
is also its data cursor.

[Note: workers decide the commit]
Waiting for the controller's ``commit`` puts a round trip through it into every step,
while DDP goes straight from its all-reduce to its optimizer. So on most steps
(``decide``) the workers take the decision themselves, exactly as the controller would:
after the gradient all-reduce each worker says whether its step is ready (finite loss
and gradient norm, `StepStats.finite`, what the controller checks too), and one
all-gather over the whole generation (`StageComm.exchange`: the flag, the loss and the
gradient norm of every worker, on connections of its own: [Note: the vote's own
connections] in parallelism/commit_vote.py) tells everyone whether all are. If so each applies the
step at once and reports it committed, with everyone's loss and norm -- so the step's
record is whole even if a worker dies applying it -- and the controller only books it.
If not, nobody applies anything, and the controller handles the reports as it handles a
two-phase step's. Steps that need the controller first keep the two phases: a
fingerprint vote's, a shrunk job's. With the decision on the workers, the controller can
send the next steps before a step is back, and several in one call (`run_steps`; see
[Note: batched steps] in recovery/runtime/steps.py); a worker skips a step sent
ahead of one it did not commit.

The vote can complete on some workers and fail on others (a peer dies after its flag was
passed on): those that saw "all ready" applied the step, the others hold their reduced
gradients and report it (``held``) -- and since a complete vote needed every flag,
"all ready" was true. The controller then rolls the holders forward (``commit``) before
anyone leaves, so every survivor has the step; a vote that completed nowhere leaves the
step uncommitted everywhere, as a failure before a two-phase commit does. That includes a
vote that completed only on a worker that then died: its last bytes of the all-gather
can die with its sockets, and its commit with it. No survivor
can be further apart: committing the next step needs the holder's vote on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from functools import partial

import torch

from parallelism.buffers import evaluating
from parallelism.engine import Share, StepStats
from parallelism.schedule import Schedule
from parallelism.spec import BatchFn, apply_lr_schedule
from recovery.faults import BitFlip, Corrupt, Fault, Kill, KillPoint, Slow, WorkerFault
from recovery.integrity.fingerprint import fingerprint, flip_bit
from recovery.policy import Timeouts
from recovery.transport import DigestsAhead
from recovery.worker.reports import StepReport, is_comm_error
from recovery.worker.snapshots import Snapshotting
from recovery.worker.transfers import StateTransfer

__all__ = ["StageWorker"]

_DEFAULT_WAIT = Timeouts().within("control")
"""`StageWorker.prepare_recovery`'s wait where its caller passes none."""
_STEP_POINTS = (KillPoint.BEFORE_FORWARD, KillPoint.MID_PIPELINE, KillPoint.DURING_ALLREDUCE)
"""The kill points inside phase one (`StageWorker.run_step`)."""
_JOBS_REMEMBERED = 8
"""How many jobs' abandoned generations a worker remembers (see `abort`)."""


class StageWorker(Snapshotting, StateTransfer):
    """One stage of one pipeline replica. See [Note: two-phase step].

    Owns the step in progress: the faults armed for it (``_faults``) and what the worker
    is doing (``_activity``, for `probe`). Everything else it reads is its bases'.

    Args:
        threads: intra-op threads for torch (set explicitly: several workers share a node).
    """

    def __init__(self, threads: int = 1) -> None:
        super().__init__(threads)
        self._faults: list[WorkerFault] = []
        self._activity = ("idle", time.time())
        self.flipped = ""
        """What the last injected `BitFlip` changed (``"<tensor>[<element>] bit <b>"``)."""

    # -- the two phases ------------------------------------------------------------------

    def run_step(
        self,
        step: int,
        faults: tuple[Fault, ...] = (),
        fingerprint: bool = False,
        decide: bool = False,
    ) -> StepReport:
        """Phase one: forward, backward and gradient all-reduce of ``step``; apply nothing
        -- or, with ``decide``, apply it if every worker is ready (see [Note: workers decide
        the commit]).

        ``faults`` are injected failures to fire at their points of this step or its commit.
        With ``fingerprint``, the report carries the fingerprint of the state this step
        starts from, taken after the all-reduce (see [Note: fingerprint vote] in
        recovery/integrity/fingerprint_vote.py). Returns a failed report (and tears down
        this generation) on a communication error, and a ``skipped`` one for a step sent
        ahead whose predecessor this worker did not commit.

        Raises:
            RuntimeError: if ``step`` is not this worker's next step.
            Exception: whatever user code raised (model, loss, data), after tearing down.
        """
        if decide and step > self.step:
            return self._skipped(step)
        self._begin_step(step, faults)
        assert self.spec is not None
        try:
            if self.shares is not None:  # a shrunk job (see [Note: elastic shrink])
                stats = self.engine.run_shares(
                    self.schedule, self.comm, self._shares(step), self._hook
                )
            else:
                self.rng.seed(self.spec.seed, "step", self.stage, self.replica, step)
                inputs, targets = self._data(self.spec.batches, step, self.schedule)
                if self.zero is not None:
                    self.zero.sync(self.comm)
                stats = self.engine.run(self.schedule, self.comm, inputs, targets, self._hook)
        except Exception as exc:
            return self._failed(step, exc)
        finally:
            self._activity = ("idle", time.time())
        report = self._report(step, stats)
        if fingerprint:
            report.fingerprint = self.fingerprint()
        return self._decided(step, report) if decide else report

    def run_steps(self, step: int, count: int, faults: tuple[Fault, ...] = ()) -> StepReport:
        """Steps ``step`` to ``step + count - 1``, each decided by the workers (see [Note:
        workers decide the commit]), stopping at the first one not committed here.
        ``faults`` strike in the first. Returns the last step's report, which carries the
        committed ones before it (``batch``)."""
        if count < 1:
            raise ValueError(f"count must be positive, got {count}")
        done: list[StepReport] = []
        for s in range(step, step + count):
            report = self.run_step(s, faults if s == step else (), decide=True)
            if not report.committed or s == step + count - 1:
                break
            done.append(report)
        report.batch = done
        return report

    def fingerprint(self) -> dict[str, str]:
        """The fingerprint of this worker's whole committed state (without the optimizer
        under ZeRO-1, whose replicas hold different optimizer shards)."""
        return fingerprint(self.own_state(), optimizer=self.zero is None)

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

    def _decided(self, step: int, report: StepReport) -> StepReport:
        """Vote on ``step`` with every worker and apply it if all are ready; see [Note:
        workers decide the commit]."""
        assert self.comm is not None
        stats = report.stats
        try:
            rows = self.comm.exchange(
                [float(stats.finite), stats.loss_sum, float(stats.losses), stats.clipped_grad_norm]
            )
        except Exception as exc:
            if not is_comm_error(exc):
                raise
            # The vote may have completed elsewhere: keep the gradients for the
            # controller to roll this worker forward (commit) or drop them.
            self.leave()
            report.ok, report.held = False, True
            report.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            return report
        if all(row[0] == 1.0 for row in rows.values()):
            report.votes = {rank: (row[1], int(row[2]), row[3]) for rank, row in rows.items()}
            self.commit(step)
            report.committed, report.finished_at = True, time.time()
        return report

    def _skipped(self, step: int) -> StepReport:
        """The report of a step sent ahead of one this worker did not commit."""
        return StepReport(
            rank=self.rank,
            step=step,
            ok=False,
            error=f"step {step} skipped: this worker has committed only up to step {self.step - 1}",
            skipped=True,
        )

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
        factor = self.progress.lr_factor(step)
        apply_lr_schedule(self.optimizer, self.spec.lr_schedule, step, self.base_lrs, factor=factor)
        self.optimizer.step()
        self.engine.buffers.apply()
        if self.zero is not None:
            mirror = self.zero.mirror_optimizer
            apply_lr_schedule(mirror, self.spec.lr_schedule, step, self.base_lrs, factor=factor)
            self.zero.step_mirror()
        self.module.zero_grad(set_to_none=True)

    def abandon(self, step: int) -> None:
        """Drop the uncommitted gradients of ``step`` (it will be run again)."""
        self._drop_step()

    def evaluate(self, index: int) -> StepReport:
        """Forward-only pass over held-out batch ``index``; losses reported by last stages.

        Evaluation leaves no trace: the stage runs in eval mode (dropout off, BatchNorm on
        its running statistics) without autograd, and its modes and buffers
        (`parallelism.buffers.evaluating`) and its random streams (``rng.kept``) are given
        back after, so a job that evaluates trains exactly as one that does not.
        """
        assert self.spec is not None and self.spec.val_batches is not None
        # A shrunk job's complete pipelines evaluate the missing ones' batches too.
        replicas = self.shares if self.shares is not None else (self.replica,)
        stats = StepStats()
        try:
            if self.zero is not None:
                self.zero.sync(self.comm)
            with self.rng.kept(), evaluating(self.module):
                for replica in replicas:
                    inputs, targets = self._data(
                        self.spec.val_batches, index, self.eval_schedule, replica, held_out=True
                    )
                    got = self.engine.run(self.eval_schedule, self.comm, inputs, targets)
                    stats.loss_sum += got.loss_sum
                    stats.losses += got.losses
        except Exception as exc:
            return self._failed(self.step, exc)
        return StepReport(rank=self.rank, step=self.step, ok=True, stats=stats)

    # -- helpers -------------------------------------------------------------------------

    def _data(
        self,
        fn: BatchFn,
        index: int,
        schedule: Schedule,
        replica: int | None = None,
        *,
        held_out: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Pipeline ``replica``'s microbatches of batch ``index`` (default: this worker's).

        [Note: one draw for every stage]
        The first stage of a route reads a batch's inputs and the last its targets, each
        calling ``fn`` in its own process. They must get the same samples, even from a
        dataset that augments or masks at random: so ``fn`` runs with every random
        generator it may use (torch's, Python's, NumPy's) seeded from the batch alone --
        ``(seed, "data", replica, index)``, never the stage -- and given back after, so the
        step's own randomness (dropout) is unchanged.
        """
        assert self.spec is not None
        replica = self.replica if replica is None else replica
        ends = {schedule.first_stage(m) for m in range(schedule.num_microbatches)}
        ends |= {schedule.last_stage(m) for m in range(schedule.num_microbatches)}
        if self.stage not in ends:  # a middle stage never touches data
            return [], []
        keys = (self.spec.seed, "held-out" if held_out else "data", replica, index)
        with self.rng.drawing(*keys):
            batch = fn(index, replica, self.topology.replicas)
        return self.spec.split(batch, step=index, replica=replica)

    def _shares(self, step: int) -> list[Share]:
        """The shares of a shrunk step: each replica's data, seeded as its own worker's."""
        assert self.spec is not None and self.shares is not None
        return [Share(replica, partial(self._share_data, step, replica)) for replica in self.shares]

    def _share_data(self, step: int, replica: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        assert self.spec is not None
        self.rng.seed(self.spec.seed, "step", self.stage, replica, step)
        return self._data(self.spec.batches, step, self.schedule, replica)

    def _drop_step(self) -> None:
        """Forget everything of the uncommitted step: its gradients, and the buffer values
        its forward passes left (see [Note: buffers are state] in parallelism/buffers.py)."""
        self.module.zero_grad(set_to_none=True)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.buffers.drop()

    def _failed(self, step: int, exc: Exception) -> StepReport:
        if is_comm_error(exc):
            # Another worker failed first and the step was aborted before this one's own
            # injected kill struck: the failures injected into one step strike together,
            # so it dies now instead of in the retried step.
            for fault in self._faults:
                if isinstance(fault, Kill) and fault.at in _STEP_POINTS:
                    self._hook(fault.at.value)
        # Tear down first so that peers blocked on us fail fast (see [Note: tearing down on
        # failure] in parallelism/comm/gloo_sockets.py).
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
            if isinstance(fault, Slow):  # from now on, until this worker is replaced
                self.slowdown = fault.factor
                continue
            self._record_fault_time()
            if isinstance(fault, Corrupt):
                with torch.no_grad():  # a flipped bit: nothing fails, the numbers go bad
                    next(self.module.parameters()).view(-1)[0] = float("nan")
                continue
            if isinstance(fault, BitFlip) and fault.in_flight:  # strikes the next send
                self.flip_in_flight = fault.seed
                continue
            if isinstance(fault, BitFlip):  # finite and wrong: only a fingerprint vote sees it
                self.flipped = flip_bit(self.own_state(), fault.seed, optimizer=self.zero is None)
                continue
            if isinstance(fault, Kill):
                self._die()
            self._activity = ("hung", time.time())
            self._hang()

    def _die(self) -> None:
        """An injected kill: a real death, no cleanup, no goodbye (overridden by workers
        that run as threads, see recovery/groups/thread_group.py)."""
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
        blocked on a peer is a victim of a hang, not its cause. ``idle_s`` is how long ago
        it last made progress: began its current activity or finished a schedule action.
        """
        kind, since = self._activity
        waiting = self.comm.waiting_on if self.comm is not None else None
        if getattr(self.rng, "waiting", False):  # a thread worker waiting for another's draws
            waiting = -1
        idle = time.time() - since
        engine = getattr(self, "engine", None)
        if engine is not None:
            idle = min(idle, time.monotonic() - engine.progressed_at)
        return {
            "activity": kind,
            "since": since,
            "waiting_on": waiting,
            "step": self.step,
            "idle_s": idle,
        }

    def abort(self, generation: int | None = None, job: str = "") -> None:
        """Abandon the running step from outside it: tear down this generation's groups.

        Called from a control thread while ``run_step`` may be running: its next (or
        current) communication fails, and peers blocked on this worker wake up. A
        generation still being formed is given up (see [Note: abandoning a formation]);
        ``generation``: give up forming that one (and any older) of ``job`` even if its
        ``join`` has not begun here yet -- the abort can overtake the call it is meant for.
        An abort of another job's generation touches nothing here: it was on its way when
        that job ended, and this worker has been parked and taken by another job since.
        """
        if generation is not None:
            self.abandoned[job] = max(self.abandoned.get(job, -1), generation)
            while len(self.abandoned) > _JOBS_REMEMBERED:
                del self.abandoned[next(iter(self.abandoned))]
            if job != self.job or self.joining > generation:  # another job's, or late
                return
        forming = self.forming
        if forming is not None:
            forming.set()
        comm = self.comm
        if comm is not None:
            comm.close()

    def prepare_recovery(self, source: bool = False, wait: timedelta = _DEFAULT_WAIT) -> StepReport:
        """Abandon the uncommitted step and leave the generation.

        ``source``: this worker's stage lost a replica, so it may be asked for its state;
        its digests are taken meanwhile (see [Note: digests taken ahead] in
        recovery/transport/process_group.py). ``wait``: how long durable writes in flight
        may take to land (`Timeouts.within` the controller's wait on this call). Returns
        the committed step and what redundancy this worker holds (peer snapshots,
        finished durable writes), for the planner.
        """
        self._drop_step()
        self._faults = []
        self.leave()
        if source and self.spec is not None:
            self.digests_ahead = DigestsAhead.start(self.own_state())
        return self.flush_snapshots(wait)  # let durable writes land before anyone prunes
