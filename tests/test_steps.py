"""The step runner alone (recovery/runtime/steps.py), over a fake group: no process groups,
no threads -- each call is answered at once by a scripted worker. What is checked is the
protocol: which calls go out, how steps are batched and sent ahead, when the controller's
commit is sent, and what each kind of failure becomes."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from parallelism.engine import StepStats
from parallelism.topology import Topology
from recovery.faults import FailureSchedule
from recovery.faults.injection import InjectedFaults
from recovery.groups.group import Call, CallResults, Warmup, WorkerGroup, WorkerLost
from recovery.names import FailureCause
from recovery.policy import RecoveryPolicy
from recovery.runtime.steps import BATCH_STEPS, Committed, Failed, StepRunner
from recovery.worker import StepReport, WorkerInfo
from tests.workloads import mlp_spec

TOP = Topology(2, 3)


@dataclass
class Script:
    """What the fake workers do: who dies at which step, who reports a NaN or an odd
    fingerprint; every call made, in order."""

    dies_at: dict[int, int] = field(default_factory=dict)
    nan_at: dict[int, int] = field(default_factory=dict)
    odd_at: dict[int, int] = field(default_factory=dict)
    dies_in_commit: dict[int, int] = field(default_factory=dict)
    calls: list[tuple[int, str, tuple[Any, ...]]] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)
    step_s: float = 0.0


class FakeWorker:
    def __init__(self, rank: int, script: Script) -> None:
        self.rank, self.script = rank, script

    def _report(self, step: int, *, check: bool = False, committed: bool = False) -> StepReport:
        loss = math.nan if self.script.nan_at.get(self.rank) == step else 1.0
        odd = self.script.odd_at.get(self.rank) == step
        return StepReport(
            rank=self.rank,
            step=step,
            ok=True,
            stats=StepStats(loss_sum=loss, losses=1, grad_norm=1.0),
            fingerprint={"w": "odd" if odd else "even"} if check else None,
            committed=committed,
            finished_at=time.time(),
        )

    def _dies(self, step: int) -> bool:
        return self.script.dies_at.get(self.rank) == step

    def run_steps(self, step: int, count: int, faults: Sequence[object]) -> StepReport:
        """The workers decide: each step is committed unless someone died in it, which
        every other worker sees as a failed vote."""
        time.sleep(self.script.step_s * count)
        chain = []
        for s in range(step, step + count):
            if self._dies(s):
                self.script.dead.add(self.rank)
                raise WorkerLost(self.rank, "killed")
            if any(at == s for at in self.script.dies_at.values()):
                chain.append(StepReport(self.rank, s, ok=False, error="Connection reset by peer"))
                break
            if s in self.script.nan_at.values():  # the vote saw a NaN: nobody commits
                chain.append(self._report(s))  # ran, not ready: the two-phase path
                break
            chain.append(self._report(s, committed=True))
        *before, last = chain
        last.batch = before
        return last

    def run_step(
        self, step: int, faults: Sequence[object], check: bool, decide: bool
    ) -> StepReport:
        if self._dies(step):
            self.script.dead.add(self.rank)
            raise WorkerLost(self.rank, "killed")
        return self._report(step, check=check)

    def commit(self, step: int) -> None:
        if self.script.dies_in_commit.get(self.rank) == step:
            self.script.dead.add(self.rank)
            raise WorkerLost(self.rank, "killed while applying the step")

    def abort(self, generation: int) -> None:
        return None

    def evaluate(self, index: int) -> StepReport:
        return self._report(-1)


class FakeGroup(WorkerGroup):
    """Calls answered at once by `FakeWorker`s; only what the runner uses."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.workers = {r: FakeWorker(r, script) for r in range(TOP.world_size)}
        self.spares = 0

    def _send(self, rank: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        self.script.calls.append((rank, name, args))
        if rank in self.script.dead:
            return Call(rank, name, WorkerLost(rank, "dead"))
        try:
            return Call(rank, name, getattr(self.workers[rank], name)(*args, **kwargs))
        except Exception as exc:
            return Call(rank, name, exc)

    def wait(
        self, calls: Sequence[Call], timeout: timedelta | float, *, first: bool = False
    ) -> tuple[list[Call], list[Call]]:
        return list(calls), []

    def result(self, call: Call) -> Any:
        if isinstance(call.handle, Exception):
            raise call.handle
        return call.handle

    def ranks(self) -> list[int]:
        return [r for r in self.workers if r not in self.script.dead]

    def kill(self, ranks: Iterable[int]) -> None:
        self.script.dead |= set(ranks)

    def spare_count(self) -> int:
        return self.spares

    def info(self, rank: int) -> WorkerInfo:
        return WorkerInfo(pid=rank, node_id="node", host="host")

    def nodes(self) -> list[str]:
        return ["node"]

    def start(self, *args: Any, **kwargs: Any) -> tuple[CallResults, set[int]]:
        raise NotImplementedError

    def add_spares(self, nodes: Sequence[str], warm: Warmup) -> None:
        self.spares += len(nodes)

    def await_spares(self, timeout: timedelta | float, place_timeout: Any = None) -> int:
        return self.spares

    def spare_nodes(self) -> list[str]:
        return ["node"] * self.spares

    def ready_spare_nodes(self) -> list[str]:
        return self.spare_nodes()

    def shutdown(self, *, clean: bool) -> None:
        return None


class FakeMembers:
    def __init__(self, group: FakeGroup) -> None:
        self.group = group
        self.missing: set[int] = set()
        self.store = dist.HashStore()
        self.generation = 0

    def present(self) -> list[int]:
        return [r for r in range(TOP.world_size) if r not in self.missing]

    def on_lost_node(self, ranks: object) -> bool:
        return False

    def add_spares(self, count: int, *, anywhere: bool = False) -> None:
        self.group.add_spares(["node"] * max(0, count), lambda: (FakeWorker.commit, (0,)))


class FakePersistence:
    def __init__(self, script: Script, every: int = 0) -> None:
        self.script, self.every = script, every
        self.taken: list[int] = []

    def note(self, reports: object) -> None:
        return None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def after_commit(self, step: int) -> None:
        if self.due(step):
            self.taken.append(step)
            self.script.calls.append((-1, "snapshot", (step,)))


def runner(
    script: Script, policy: RecoveryPolicy | None = None, persistence: FakePersistence | None = None
) -> tuple[StepRunner, FakeGroup]:
    group = FakeGroup(script)
    made = StepRunner(
        group=group,
        members=FakeMembers(group),  # type: ignore[arg-type]
        persistence=persistence or FakePersistence(script),  # type: ignore[arg-type]
        faults=InjectedFaults(FailureSchedule(), TOP),
        spec=mlp_spec(),
        topology=TOP,
        policy=policy or RecoveryPolicy(),
        eval_every=0,
        eval_batches=1,
        tokens_per_step=0,
        step=0,
        started_at=time.perf_counter(),
        started_wall=time.time(),
    )
    return made, group


def run_to(made: StepRunner, target: int) -> list[Committed | Failed]:
    out = []
    while made.step < target:
        made.group.script.calls.append((-1, "advance", (len(out),)))  # type: ignore[attr-defined]
        result = made.advance(target)
        out.append(result)
        if isinstance(result, Failed):
            break
    return out


def names(script: Script, rank: int = 0) -> list[str]:
    return [
        f"{n} {a[0]}" + (f"+{a[1]}" if n == "run_steps" else "")
        for r, n, a in script.calls
        if r == rank
    ]


def test_the_workers_decide_and_steps_go_out_batched_and_ahead() -> None:
    script = Script(step_s=0.001)
    made, _ = runner(script)
    results = run_to(made, 40)
    assert all(isinstance(r, Committed) for r in results)
    assert [rec.step for r in results for rec in r.records] == list(range(40))
    calls = names(script)
    assert calls[0] == "run_steps 0+1"  # one step until a step was timed
    counts = [int(c.split("+")[1]) for c in calls]
    assert sum(counts) == 40 and max(counts) == BATCH_STEPS  # 1 ms steps: full batches
    assert all(c.startswith("run_steps") for c in calls)  # no commit calls: the workers decide
    order = [(n, a) for r, n, a in script.calls if r in (-1, 0)]
    second = order.index(("advance", (1,)))
    assert ("run_steps", (1, 1, ())) in order[:second]  # sent ahead, during the first advance


def test_a_fingerprint_step_is_committed_by_the_controller() -> None:
    script = Script()
    made, _ = runner(script, RecoveryPolicy(fingerprint_every=4))
    results = run_to(made, 9)
    assert all(isinstance(r, Committed) for r in results)
    assert [c for c in names(script) if not c.startswith("run_steps")] == [
        "run_step 0",
        "commit 0",
        "run_step 4",
        "commit 4",
        "run_step 8",
        "commit 8",
    ]
    assert made.verified == 8


def test_a_death_inside_a_batch_books_the_steps_before_it() -> None:
    script = Script(dies_at={3: 5})
    made, _ = runner(script)
    results = run_to(made, 20)
    failed = results[-1]
    assert isinstance(failed, Failed)
    committed = [rec.step for r in results for rec in r.records]
    assert committed == list(range(5))  # every step before the death, none after
    assert failed.failure.step == 5 and failed.failure.lost == {3}
    assert failed.failure.cause is FailureCause.KILLED
    assert made.step == 5


def test_a_non_finite_loss_is_never_committed() -> None:
    script = Script(nan_at={2: 3})
    made, _ = runner(script)
    results = run_to(made, 10)
    failed = results[-1]
    assert isinstance(failed, Failed) and failed.failure.cause is FailureCause.NUMERICAL
    assert failed.failure.numerical and failed.failure.step == 3 and failed.failure.lost == set()
    assert [rec.step for r in results for rec in r.records] == [0, 1, 2]
    assert "commit 3" not in names(script)


def test_an_odd_fingerprint_is_outvoted_and_never_committed() -> None:
    script = Script(odd_at={TOP.rank(1, 2): 2})
    made, _ = runner(script, RecoveryPolicy(fingerprint_every=1))
    results = run_to(made, 5)
    failed = results[-1]
    assert isinstance(failed, Failed) and failed.failure.cause is FailureCause.CORRUPTED
    assert failed.failure.lost == {TOP.rank(1, 2)} and failed.failure.step == 2
    assert "commit 2" not in names(script) and made.verified == 1


def test_nothing_goes_ahead_of_a_snapshot() -> None:
    """A snapshot is taken of the state after step k - 1: no call that runs step k may go
    out before it ([Note: pipelined commit])."""
    script = Script(step_s=0.001)
    persistence = FakePersistence(script, every=5)
    made, _ = runner(script, persistence=persistence)
    run_to(made, 30)
    assert persistence.taken == [5, 10, 15, 20, 25, 30]
    order = [(n, a) for r, n, a in script.calls if r in (-1, 0)]
    for k in persistence.taken:
        at = order.index(("snapshot", (k,)))
        for n, a in order[:at]:
            if n == "run_steps":
                assert a[0] + a[1] <= k, (k, a)  # every step it ran is before k
    assert any(n == "run_steps" and a[1] > 1 for n, a in order)  # batches still formed


def test_a_recovery_event_closes_at_the_first_commit_and_spares_restock_after_it() -> None:
    script = Script(step_s=0.001)
    made, group = runner(script, RecoveryPolicy(hot_spares=1))
    closed: list[bool] = []

    class Event:
        def close(self, *, resumed: bool) -> str:
            closed.append(resumed)
            return "closed"

    made.resume(0, verified=0, event=Event(), restock=True)  # type: ignore[arg-type]
    made.restock_spares()  # nothing committed since the recovery: too early
    assert group.spares == 0
    first = made.advance(30)
    assert isinstance(first, Committed) and first.event == "closed" and closed == [True]
    assert [rec.step for rec in first.records] == [0]  # settled alone, nothing sent ahead
    assert group.spares == 0  # not before the controller has published the event
    made.restock_spares()
    assert group.spares == 1
    made.restock_spares()
    assert group.spares == 1  # once
    assert made.close_event() is None


def test_a_worker_lost_applying_a_pipelined_commit_fails_the_next_step() -> None:
    """[Note: pipelined commit]: the commit of step 2 goes out with nothing waited for; a
    worker that dies applying it is found when the commits are waited for: step 2 stands,
    step 3 fails."""
    script = Script(dies_in_commit={1: 2})
    made, _ = runner(script, RecoveryPolicy(fingerprint_every=1))  # the controller commits
    results = run_to(made, 10)
    failed = results[-1]
    assert isinstance(failed, Failed)
    assert failed.failure.lost == {1} and failed.failure.step == 3
    assert [rec.step for r in results for rec in r.records] == [0, 1, 2]
    calls = names(script)
    assert "run_step 3" in calls and "commit 3" not in calls  # sent, then abandoned


def test_a_commit_in_flight_is_settled_at_a_boundary() -> None:
    script = Script(dies_in_commit={4: 6})
    made, _ = runner(script, RecoveryPolicy(fingerprint_every=1))
    while made.step < 7:
        assert isinstance(made.advance(10), Committed)  # step 6's commit: sent, not waited
    failed = made.settle()  # (a grow, or the end, waits for it)
    assert isinstance(failed, Failed) and failed.failure.lost == {4} and failed.failure.step == 7
    assert made.settle() is None
