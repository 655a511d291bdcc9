"""The step runner: the failure-free step protocol, one `advance` at a time.

`StepRunner.advance()` sends the next steps to every worker and settles them: it returns
`Committed(records)` when they were committed, or `Failed(failure)` when a worker died,
hung, broke, produced a non-finite loss or disagreed in the fingerprint vote -- with the
records of any steps committed before it. What it owns: sending steps (one a call, or
several: [Note: batched steps]), sending the next ones before these are back ([Note:
pipelined commit]), the commit in its three variants (the controller's two-phase commit,
the workers deciding it themselves -- [Note: workers decide the commit] in
recovery/worker/stage.py -- and the pipelined one), the corruption gates (non-finite
values, the fingerprint vote), what follows a commit (snapshots, evaluation, the first
commit after a recovery closing its event, and then restocking the spares it took).

It decides nothing about failures: a `Failed` goes to the controller
(recovery/runtime/controller.py), which recovers and calls `resume` with the step to run
next. Tested alone over a fake group in tests/test_steps.py.

[Note: batched steps]
Even with the workers deciding the commit, one call per step costs the controller
a Ray call and a result per worker and a step's bookkeeping -- ~3 ms of CPU per
step on the 2-core machine, where it competes with the workers for the cores --
and each worker ~1 ms between two calls. So steps that need nothing from the
controller go out several to a call; the workers run them back to back, deciding
each commit among themselves, and report them together. The controller books
them when the call returns, each timed by when the workers applied it, so the
progress shown lags by at most one batch (`BATCH_S`). A failure inside a batch is
what it would be in a step of its own: the steps before it are committed and
booked, the rest are not run.

[Note: pipelined commit]
A worker runs its calls in the order the controller sent them (one Ray actor
thread; one executor per thread worker), so ``commit(k)`` is applied before
``run_step(k + 1)`` starts wherever both were sent. The runner therefore sends
the next step's calls right after the commits and waits for both together: one
round trip to every worker per step instead of two (on the 2-core machine, 10 MB
job, the gap between a commit's end and the next step's start on a worker fell
from ~2.2 ms to ~1 ms, Ray's own cost of a call). The step is committed when every
report said ready, as before; a worker that dies or breaks while applying it is
found when the commits are waited for and fails the next step, which is abandoned
everywhere and run again after the recovery -- what a death in the commit did
before, one step later. When the workers decide the commit, ``run_step(k + 1)``
goes out with ``run_step(k)``: a worker that did not commit ``k`` skips it.
Only when nothing else needs the update applied first: no snapshot or checkpoint
or evaluation due, not the last step, no recovery event waiting for its first
commit (its time runs to the commit applied), no spares to restock, not a shrunk
job (it may grow at the boundary), no injected fault due at ``nxt`` (it is
armed when sent), and no straggler found (it is replaced at the boundary: [Note:
stragglers] in recovery/runtime/stragglers.py).

[Note: restocking spares after the first step]
A spare starting is a Ray worker process importing torch, then building a stage and
running a step to warm it: seconds of CPU. Started during the recovery, it competed
with the recovery's transfer and first step wherever it shares cores with the
workers (measured on the 2-core machine, 100 MB 1x2 job: the first step after a
warm-spare recovery took 0.45 s instead of 0.25-0.30, and kill -> training again
0.72 s instead of 0.52). So a recovery only takes spares, and the job asks for new
ones after its first commit. A failure before that commit finds one spare fewer,
as it would while a spare warms up anyway. (The steps right after still share the
cores with the new spare while it starts, on a machine this small.)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.errors import RecoveryInterrupted
from recovery.events import RecoveryEvent
from recovery.faults.injection import Armed, InjectedFaults, fault_time
from recovery.groups.group import Call, WorkerGroup, WorkerLost
from recovery.integrity.fingerprint_vote import Verdict, can_vote, vote
from recovery.names import FailureCause
from recovery.policy import RecoveryPolicy
from recovery.runtime.detection import (
    StepOutcome,
    abort_pending,
    await_step,
    failure_of,
    non_finite,
)
from recovery.runtime.membership import Membership
from recovery.runtime.persistence import Persistence
from recovery.runtime.records import Failure, PendingEvent, StepRecord, step_record
from recovery.runtime.stragglers import StragglerWatch
from recovery.worker import StageWorker, StepReport

__all__ = ["BATCH_S", "BATCH_STEPS", "Committed", "Failed", "StepRunner"]

log = logging.getLogger("checkfree")

BATCH_STEPS = 16
"""The most steps the workers run in one call (see [Note: batched steps])."""
BATCH_S = 0.25
"""About how long a call of several steps lasts at most (see [Note: batched steps])."""


@dataclass
class Committed:
    """Steps committed by one `StepRunner.advance`, in order."""

    records: list[StepRecord]
    event: RecoveryEvent | None = None
    """The recovery whose first commit this was, now closed (None: none waited). Its
    spares are restocked once it is published (`StepRunner.restock_spares`)."""


@dataclass
class Failed:
    """A step that failed: what the controller recovers from."""

    failure: Failure
    records: list[StepRecord] = field(default_factory=list)
    """Steps committed before the failure in the same call, in order."""


@dataclass
class _PendingCommit:
    """A step whose commit was sent and not yet waited for (see [Note: pipelined commit])."""

    calls: dict[int, Call]
    struck_at: float
    faults: Armed


@dataclass
class _Ahead:
    """Steps sent before the ones running were settled (see [Note: pipelined commit])."""

    first: int
    count: int
    calls: dict[int, Call]


class StepRunner:
    """Runs the job's steps while nothing fails. See the module docstring.

    Args:
        step: the first step to run.
        started_at: ``perf_counter`` when training began (records are timed from it).
        started_wall: ``time.time`` at the same moment.
    """

    def __init__(
        self,
        *,
        group: WorkerGroup,
        members: Membership,
        persistence: Persistence,
        faults: InjectedFaults,
        spec: TrainSpec,
        topology: Topology,
        policy: RecoveryPolicy,
        eval_every: int,
        eval_batches: int,
        tokens_per_step: int,
        step: int,
        started_at: float,
        started_wall: float,
    ) -> None:
        self.group = group
        self.members = members
        self.persistence = persistence
        self.faults = faults
        self.spec = spec
        self.topology = topology
        self.policy = policy
        self.eval_every = eval_every
        self.eval_batches = eval_batches
        self.tokens_per_step = tokens_per_step
        self.step = step
        """The next step to run: every step before it is committed."""
        self.verified = step
        """The newest step whose fingerprints agreed in every stage group (see [Note:
        fingerprint vote] in recovery/integrity/fingerprint_vote.py): no worker's state was corrupted then."""
        self.target = step
        """Run up to here (`advance`'s argument)."""
        self.started_at = started_at
        self.started_wall = started_wall
        self.comm_errors = 0
        """Communication errors with nobody lost since the last commit (the controller
        counts them: [Note: communication errors with nobody lost])."""
        self._last: StepRecord | None = None
        self._booked: list[StepRecord] = []
        self._event: PendingEvent | None = None
        self._closed: RecoveryEvent | None = None
        self._restock = False
        self._settled = False
        """The last `advance` applied a commit with nothing sent after it."""
        self._pending_commit: _PendingCommit | None = None
        self._ahead: _Ahead | None = None
        self.stragglers = StragglerWatch(topology, policy.stragglers)  # [Note: stragglers]

    # -- what the controller calls -------------------------------------------------------

    def advance(self, target: int) -> Committed | Failed:
        """Run the next steps (at most up to ``target``) and settle them."""
        assert self.step < target, (self.step, target)
        self.target = target
        self._booked, self._closed, self._settled = [], None, False
        failure = self._train_step()
        booked, self._booked = self._booked, []
        if failure is not None:
            return Failed(failure, booked)
        return Committed(booked, self._closed)

    def settle(self) -> Failed | None:
        """Wait for the commits in flight (at a boundary: the end, a grow). A worker that
        died or broke applying them fails the step after (the one committed stands)."""
        pending = self._pending_commit
        lost = self._wait_commit()
        if lost and pending is not None:
            outcome = StepOutcome(lost=lost)
            return Failed(self._fail(self.step, outcome, pending.struck_at, pending.faults))
        return None

    def resume(
        self, step: int, *, verified: int, event: PendingEvent | None, restock: bool
    ) -> None:
        """Go on from ``step`` after a recovery. ``event`` waits for the first commit (its
        time runs until that commit is applied); ``restock``: the recovery took spares, to
        be started again after that commit (see [Note: restocking spares after the first
        step])."""
        assert self._pending_commit is None and self._ahead is None
        self.step, self.verified = step, verified
        self._event, self._restock = event, self._restock or restock
        self.stragglers.reset()  # everyone starts afresh (see [Note: stragglers])

    @property
    def idle(self) -> bool:
        """Nothing in flight: no step sent ahead, no commit not yet waited for."""
        return self._pending_commit is None and self._ahead is None

    def close_event(self) -> RecoveryEvent | None:
        """Close the recovery event still waiting for its first commit, as one the job
        did not resume from (it ended, or the next step failed too)."""
        event, self._event = self._event, None
        return event.close(resumed=False) if event is not None else None

    @property
    def last(self) -> StepRecord | None:
        """The newest step's record."""
        return self._last

    # -- one call's steps ----------------------------------------------------------------

    def _train_step(self) -> Failure | None:
        step = self.step
        start = time.perf_counter()
        struck_at = time.time()
        check = fingerprint_due(self.policy, step)
        decide = self._decides(step, check)
        ahead, faults = self._take_ahead(step), {}
        if ahead is not None:
            calls, count = ahead.calls, ahead.count
        else:
            faults = self.faults.arm(step, self.members)
            count = self._batch(step) if decide else 1
            calls = self._submit(step, count, faults, check, decide)
        broke = self._wait_commit()  # the last step's, if it was pipelined
        nxt = step + count
        if broke:  # died applying it: this step cannot complete, and is run again
            abort_pending(self.group, self.generation)(list(calls.values()))
        elif decide and self._may_send_ahead(nxt):
            # the next steps wait in the workers' queues behind these
            # (see [Note: workers decide the commit] in recovery/worker/stage.py)
            n = self._batch(nxt)
            self._ahead = _Ahead(nxt, n, self._submit(nxt, n, {}, False, True))
        outcome = await_step(self.group, calls, self.policy.timeouts.hang, self.generation)
        outcome.lost.update(broke)
        if decide:
            # Steps sent ahead began when the last one ended, not when this call began.
            began = start - self.started_at
            if ahead is not None and self._last is not None:
                began = min(began, self._last.time)
            left = self._decided(step, outcome, began, struck_at, faults)
            if not isinstance(left, StepOutcome):  # all committed, or a failure
                return left
            if self.step > step:  # some committed (their faults spent); the rest is left
                step, faults = self.step, {}
            outcome = left
        self._drop_ahead(outcome)
        if not outcome.ok:
            return self._fail(step, outcome, struck_at, faults)
        self.persistence.note(outcome.reports)
        bad = non_finite(outcome.reports)
        if bad:  # silent corruption shows up as NaN/inf: never commit it
            self.faults.spend(faults)
            numerical = StepOutcome(reports={r: outcome.reports[r] for r in bad})
            return self._fail(step, numerical, struck_at, faults, numerical=bad)
        if check:
            fingerprints = {r: rep.fingerprint for r, rep in outcome.reports.items()}
            verdict = vote(self.topology, {r: f for r, f in fingerprints.items() if f})
            if not verdict.agree:  # never commit it
                self.faults.spend(faults)
                return corruption_failure(
                    self.topology,
                    self.policy,
                    self.members,
                    verdict,
                    step,
                    self.verified,
                    struck_at,
                )
            self.verified = step
        commits = {r: self.group.submit(r, StageWorker.commit, step) for r in self.group.ranks()}
        record = self._record(step, outcome.reports, start)
        self.step = step + 1
        self._pending_commit = _PendingCommit(commits, struck_at, faults)
        if self.may_pipeline(self.step):  # the next step's calls go out before this one's are back
            self._book(record)
            return None
        failure = self.settle()
        if failure is not None:  # died while applying: committed for everyone else
            self._book(record)
            return failure.failure
        return self._after_commit(record, struck_at)

    def _decided(
        self, step: int, outcome: StepOutcome, began: float, struck_at: float, faults: Armed
    ) -> StepOutcome | Failure | None:
        """Book the steps from ``step`` on that the workers committed themselves (any one
        worker's commit of a step means all were ready), rolling forward the survivors
        whose vote on the last failed; a failure if anyone was lost or broke meanwhile. See
        [Note: workers decide the commit] in recovery/worker/stage.py.

        Returns what is left to settle the two-phase way -- the step after the committed
        ones, that every worker ran and found not ready (a non-finite loss) -- or the
        failure, or None (all settled).
        """
        chains = {r: [*rep.batch, rep] for r, rep in outcome.reports.items()}
        done = [rep for chain in chains.values() for rep in chain if rep.committed]
        if not done:
            return outcome
        self.faults.spend(faults)
        self.comm_errors = 0
        last = max(rep.step for rep in done)
        lost = dict(outcome.lost)
        held = sorted(r for r, rep in outcome.reports.items() if rep.held and rep.step == last)
        if held:
            rolled = self.group.gather(
                {r: self.group.submit(r, StageWorker.commit, last) for r in held},
                self.policy.timeouts.hang,
            )
            lost.update(rolled.as_lost())
        records = []
        since = began  # each step is timed from the one before, by when the workers applied it
        for s in range(step, last + 1):
            reports = {
                r: rep
                for r, chain in chains.items()
                for rep in chain
                if rep.step == s and (rep.committed or rep.held)
            }
            self.persistence.note(reports)
            finished = max((rep.finished_at for rep in reports.values()), default=0.0)
            at = max(finished - self.started_wall, since)
            records.append(self._record(s, reports, elapsed=at - since, since_start=at))
            since = at
        self.step = last + 1
        failed = {r: rep for r, rep in outcome.reports.items() if not rep.ok}  # held ones too
        if lost or failed or outcome.hung:
            after = self._drop_ahead(StepOutcome(reports=failed, lost=lost))
            for record in records:
                self._book(record)
            lost.update(after.lost)
            failed.update({r: rep for r, rep in after.reports.items() if not rep.ok})
            broken = StepOutcome(reports=failed, lost=lost, hung=outcome.hung | after.hung)
            if not broken.ok:
                return self._fail(self.step, broken, struck_at, {})
        for record in records[:-1]:
            self._book(record)
        if any(not rep.committed for rep in outcome.reports.values()):
            self._book(records[-1])
            return outcome  # ran and found not ready everywhere: the numerical path
        if self._ahead is not None:
            self._book(records[-1])
            return None
        return self._after_commit(records[-1], struck_at)

    def _after_commit(self, record: StepRecord, struck_at: float) -> Failure | None:
        """What follows a commit that nothing was sent after: snapshots, evaluation, the
        recovery event's close, new spares."""
        try:
            if not self.members.missing:  # a shrunk job takes no snapshots (elastic.py)
                self.persistence.after_commit(self.step)
        except RecoveryInterrupted as exc:  # lost while snapshotting: the step is committed
            self._book(record)
            lost = {rank: WorkerLost(rank, str(exc)) for rank in exc.lost}
            broken = {  # alive, their call failed on a peer: not lost (a retry, if alone)
                rank: StepReport(rank=rank, step=self.step, ok=False, error=str(exc))
                for rank in exc.broken - exc.lost
            }
            return self._fail(self.step, StepOutcome(reports=broken, lost=lost), struck_at, {})
        failure = None
        if self.eval_every and (self.step % self.eval_every == 0 or self.step == self.target):
            record.val_loss, failure = self.evaluate()
        self._book(record)
        if self._event is not None:  # (committed, even if its evaluation then failed)
            self._closed, self._event = self._event.close(resumed=True), None
        self._settled = True
        return failure

    def _record(
        self,
        step: int,
        reports: dict[int, StepReport],
        start: float | None = None,
        *,
        elapsed: float | None = None,
        since_start: float | None = None,
    ) -> StepRecord:
        """The record of ``step``, timed from ``start`` (``perf_counter``) to now, or as
        given (the steps of a batch, timed by when the workers applied them)."""
        self.stragglers.note(step, reports, shrunk=bool(self.members.missing))
        now = time.perf_counter()
        return step_record(
            self.topology,
            step,
            reports,
            elapsed=elapsed if elapsed is not None else now - (start or now),
            since_start=since_start if since_start is not None else now - self.started_at,
            tokens_per_step=self.tokens_per_step,
            generation=self.generation,
        )

    def _book(self, record: StepRecord) -> None:
        self._last = record
        self._booked.append(record)

    @property
    def generation(self) -> int:
        return self.members.generation

    # -- sending -------------------------------------------------------------------------

    def _decides(self, step: int, check: bool) -> bool:
        """Whether the workers decide ``step``'s commit themselves (see [Note: workers
        decide the commit] in recovery/worker/stage.py): not when the controller must
        look first (a fingerprint vote), nor in a shrunk job."""
        return not check and not self.members.missing

    def _submit(
        self, step: int, count: int, faults: Armed, check: bool, decide: bool
    ) -> dict[int, Call]:
        """Send ``step`` to every worker -- with ``decide``, it and the ``count - 1`` after
        it, in one call (`StageWorker.run_steps`)."""
        if decide:
            return {
                r: self.group.submit(r, StageWorker.run_steps, step, count, faults.get(r, ()))
                for r in self.members.present()
            }
        return {
            r: self.group.submit(r, StageWorker.run_step, step, faults.get(r, ()), check, False)
            for r in self.members.present()
        }

    def _batch(self, step: int) -> int:
        """How many steps from ``step`` the workers run in one call: while nothing needs
        the controller between two of them, up to `BATCH_STEPS` and about `BATCH_S` of
        training (by the last step's time; one until a step was timed).
        """
        last = self._last.step_s if self._last is not None else 0.0
        if last <= 0:
            return 1
        most = max(1, min(BATCH_STEPS, int(BATCH_S / last)))
        n = 1
        while n < most and self._may_send_ahead(step + n):
            n += 1
        return n

    def _may_send_ahead(self, step: int) -> bool:
        """Whether ``step`` may go out before the one before it is back: the workers decide
        it and nothing needs the controller between the two."""
        return self.may_pipeline(step) and self._decides(step, fingerprint_due(self.policy, step))

    def _take_ahead(self, step: int) -> _Ahead | None:
        """The steps from ``step`` if they were sent ahead."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            assert ahead.first == step, (ahead.first, step)
        return ahead

    def _drop_ahead(self, outcome: StepOutcome) -> StepOutcome:
        """The steps sent ahead are void (the one before failed or is not committed
        everywhere): abort them and wait for their calls (a worker that did not commit the
        steps before skips them). Returns their outcome."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return StepOutcome()
        if not outcome.ok:
            abort_pending(self.group, self.generation)(list(ahead.calls.values()))
        return await_step(self.group, ahead.calls, self.policy.timeouts.hang, self.generation)

    def may_pipeline(self, nxt: int) -> bool:
        """Whether step ``nxt``'s calls may go out before the step before it is settled:
        after its commit call (the commit is then waited for with ``nxt``'s reports), or,
        when the workers decide, behind its run.
        """
        return (
            nxt < self.target
            and self._event is None
            and not self._restock
            and not self.members.missing
            and not self.persistence.due(nxt)
            and not (self.eval_every and nxt % self.eval_every == 0)
            and not (self.faults.due(nxt) or self.stragglers.found)
        )

    def _wait_commit(self) -> dict[int, WorkerLost]:
        """Wait for the commits in flight: the workers that died or broke applying them
        (their step stays committed for everyone else)."""
        pending, self._pending_commit = self._pending_commit, None
        if pending is None:
            return {}
        commits = self.group.gather(pending.calls, self.policy.timeouts.hang)
        lost = commits.as_lost()  # a worker that broke mid-update is rebuilt, too
        self.faults.spend(pending.faults, lost or None)
        if not lost:
            self.comm_errors = 0
        return lost

    def restock_spares(self) -> None:
        """Start the spares a recovery took, once training is back: after the first
        commit applied since (the controller calls it once it has published what that
        commit closed).
        """
        if not (self._restock and self._settled):
            return
        self._restock = False
        self.members.add_spares(self.policy.hot_spares - self.group.spare_count())

    # -- evaluation and the gates --------------------------------------------------------

    def evaluate(self) -> tuple[float | None, Failure | None]:
        """Mean held-out loss over ``eval_batches`` batches (forward only, every pipeline).

        A failure during evaluation is one like a step's: the evaluation is skipped
        (None) and the failure returned.
        """
        if self.spec.val_batches is None:
            return math.nan, None
        total, count = 0.0, 0
        for index in range(self.eval_batches):
            struck_at = time.time()
            calls = {
                r: self.group.submit(r, StageWorker.evaluate, index) for r in self.members.present()
            }
            outcome = await_step(self.group, calls, self.policy.timeouts.hang, self.generation)
            if not outcome.ok:
                return None, self._fail(self.step, outcome, struck_at, {})
            total += sum(r.stats.loss_sum for r in outcome.reports.values())
            count += sum(r.stats.losses for r in outcome.reports.values())
        return (total / count if count else math.nan), None

    def _fail(
        self,
        step: int,
        outcome: StepOutcome,
        struck_at: float,
        faults: Armed,
        *,
        numerical: dict[int, str] | None = None,
    ) -> Failure:
        lost = set(outcome.lost)
        injected = fault_time(
            self.members.store, self.generation, lost | set(numerical or outcome.failed)
        )
        self.faults.spend(faults, lost | outcome.hung)
        failure = failure_of(
            step,
            outcome,
            numerical=numerical,
            node_lost=self.members.on_lost_node(lost),
            struck_at=injected if injected is not None else struck_at,
            generation=self.generation,
        )
        log.warning(
            "step %d failed (%s): lost %s",
            step,
            failure.cause,
            ", ".join(str(self.topology.worker(r)) for r in sorted(lost)) or "nobody",
        )
        return failure


def fingerprint_due(policy: RecoveryPolicy, step: int) -> bool:
    """Whether the workers fingerprint their state at ``step``: every ``fingerprint_every``
    steps, and at every snapshot step, so that the newest snapshot known clean is always one
    the workers still keep (see [Note: fingerprint vote] in recovery/integrity/fingerprint_vote.py)."""
    every = policy.fingerprint_every or 0
    if every <= 0:
        return False
    snapshots = policy.snapshots
    return any(n and step % n == 0 for n in (every, snapshots.peer_every, snapshots.durable_every))


def corruption_failure(
    topology: Topology,
    policy: RecoveryPolicy,
    members: Membership,
    verdict: Verdict,
    step: int,
    verified: int,
    struck_at: float,
) -> Failure:
    """A fingerprint mismatch at ``step``: the odd workers are lost if the majority can
    rebuild them, else nobody is and everyone rolls back (see [Note: fingerprint vote])."""
    voted = can_vote(verdict, step, verified, policy)
    injected = fault_time(members.store, members.generation, verdict.suspects)
    failure = Failure(
        step=step,
        lost=set(verdict.suspects) if voted else set(),
        cause=FailureCause.CORRUPTED,
        detected_at=time.time(),
        struck_at=injected if injected is not None else struck_at,
        errors=verdict.describe(topology),
        generation=members.generation,
        corruption=verdict,
    )
    log.warning(
        "step %d: fingerprints disagree in stage(s) %s (last agreed at step %d): %s",
        step,
        list(verdict.mismatched),
        verified,
        "; ".join(f"{topology.worker(r)}: {e}" for r, e in sorted(failure.errors.items())),
    )
    return failure
