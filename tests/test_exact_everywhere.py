"""Exact on every path: a randomized, model-based test of the whole runtime.

Hypothesis draws a job -- a model (an MLP; a CNN with BatchNorm, dropout and augmented
images; a small transformer with dropout), a topology, a recovery policy (exact with
fingerprints and snapshots, CheckFree, ZeRO-1, elastic), evaluation on or off -- and a
sequence of faults: kills at any kill point, bursts, a second death inside the recovery
(in any of its calls), a stage wiped out, a bit flipped. The job runs on the thread worker
group (real workers, real Gloo groups, seconds per example) and is compared with the
same job run without faults:

- where every recovery was exact (replica copies, shard mirrors, rollbacks, the replica
  vote, a shrink with two replicas), the losses and every final tensor -- parameters,
  buffers, optimizer state -- and progress, ``torch.equal``;
- after a CheckFree rebuild, the replicas of every stage equal to each other (their
  progress too: the rebuilt stage's carries the rebuild's mark), and the losses finite;
  the rebuild's formula is tests/test_checkfree_runtime.py's;
- after a shrink with three replicas (the shares are summed in another order than the
  ring's), every tensor within the chaos tool's relative tolerance, replicas equal.

Every fault is checked to have fired where it was meant to. CI runs the examples below
(derandomized); ``CHECKFREE_EXAMPLES=N`` runs N random ones (docs/testing.md says how many a
longer run passed).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from parallelism import Topology
from recovery import BitFlip, Kill, KillPoint, RecoveryPolicy, SnapshotPolicy, TrainSpec
from recovery.reference import differences
from recovery.runtime import Controller
from recovery.runtime import Phase as JobPhase
from recovery.state import Progress
from recovery.trainer import final_trajectory
from tests.jobs import drive, make
from tests.workloads import bn_cnn_spec, held_out_batches, mlp_spec, transformer_spec

STEPS = 8
STATE_RTOL = 1e-4
"""A shrunk job of 3+ replicas against the failure-free run (as scripts/chaos.py holds it)."""
CI_EXAMPLES = 16
"""Derandomized draws in the default run (scripts/test_slow.sh runs 100 random ones more)."""
EXAMPLES = int(os.environ.get("CHECKFREE_EXAMPLES", "0"))
"""Random examples to run instead of CI's fixed ones (0: CI's)."""

MODELS = ("mlp", "bn-cnn", "transformer")
POLICIES = ("exact", "checkfree", "zero1", "elastic")
TOPOLOGIES = (Topology(2, 2), Topology(2, 3), Topology(3, 2))
METHODS = ("prepare_recovery", "join", "setup", "send_state", "recv_state")


@dataclass(frozen=True)
class Death:
    """A death from outside inside the recovery that ``first`` starts: ``victim`` dies at
    its first ``method`` call once a recovery is under way."""

    first: Kill
    victim: int
    method: str


@dataclass(frozen=True)
class Case:
    model: str
    top: Topology
    policy: str
    evaluate: bool
    hot_spares: int
    faults: tuple[Kill | BitFlip | Death, ...]

    def spec(self) -> TrainSpec:
        return _spec(self.model, self.policy == "zero1")

    def recovery_policy(self) -> RecoveryPolicy:
        if self.policy == "exact":
            return RecoveryPolicy(
                snapshots=SnapshotPolicy(peer_every=2),
                fingerprint_every=2,
                hot_spares=self.hot_spares,
            )
        if self.policy == "checkfree":
            return RecoveryPolicy(
                approximate="checkfree",
                snapshots=SnapshotPolicy(peer_every=2),
                hot_spares=self.hot_spares,
            )
        if self.policy == "elastic":
            return RecoveryPolicy(
                elastic=True, snapshots=SnapshotPolicy(peer_every=2), hot_spares=0
            )
        return RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=2), hot_spares=self.hot_spares)

    def __str__(self) -> str:
        return (
            f"{self.model} {self.top} {self.policy} eval={self.evaluate} "
            f"spares={self.hot_spares} faults={list(self.faults)}"
        )


@functools.cache
def _spec(model: str, zero: bool) -> TrainSpec:
    if model == "mlp":
        return mlp_spec(val_batches=held_out_batches, shard_optimizer=zero)
    if model == "bn-cnn":
        return bn_cnn_spec(shard_optimizer=zero)
    return transformer_spec(shard_optimizer=zero)


# -- drawing a case ------------------------------------------------------------------------


def _workers(top: Topology) -> list[tuple[int, int]]:
    return [(w.stage, w.replica) for w in top.workers()]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    model = draw(st.sampled_from(MODELS))
    top = draw(st.sampled_from(TOPOLOGIES))
    policy = draw(st.sampled_from(POLICIES))
    if policy == "zero1" and model == "mlp" and top.replicas > 2:
        policy = "exact"  # an MLP stage has 2 parameter tensors: not enough for 3 shards
    kinds = ["kill", "burst", "death"] + (["flip"] if policy == "exact" else [])
    steps = sorted(draw(st.sets(st.integers(1, STEPS - 2), min_size=1, max_size=2)))
    faults: list[Kill | BitFlip | Death] = []
    for step in steps:
        # A stage wiped out comes back from a snapshot (CheckFree: from its neighbours): one
        # taken at least a step before, after any other recovery, so that its copies have
        # reached their buddies -- the last event, from step 5 on (snapshots every 2 steps).
        wipe = step == steps[-1] and step >= 5
        kind = draw(st.sampled_from([*kinds, "wipe"] if wipe else kinds))
        faults.extend(_draw_fault(draw, kind, step, top, policy))
    assume(not _flip_unwitnessed(faults, top))
    return Case(
        model=model,
        top=top,
        policy=policy,
        evaluate=draw(st.booleans()),
        hot_spares=draw(st.sampled_from([0, 1])),
        faults=tuple(faults),
    )


def _flip_unwitnessed(faults: list[Kill | BitFlip | Death], top: Topology) -> bool:
    """A flip whose stage loses a mate before the next vote (every 2 steps) can leave the
    flipped replica as the stage's only source: the replacement is copied from it and nothing
    is left to vote against (docs/silent-data-corruption.md: what it cannot detect)."""
    for flip in (f for f in faults if isinstance(f, BitFlip)):
        for fault in faults:
            kills = [fault.first] if isinstance(fault, Death) else [fault]
            if isinstance(fault, Death):
                victim = top.worker(fault.victim)
                kills.append(
                    Kill(step=fault.first.step, stage=victim.stage, replica=victim.replica)
                )
            for kill in kills:
                if (
                    isinstance(kill, Kill)
                    and kill.stage == flip.stage
                    and kill.replica != flip.replica
                    and flip.step <= kill.step <= flip.step + 2
                ):
                    return True
    return False


def _draw_fault(
    draw: st.DrawFn, kind: str, step: int, top: Topology, policy: str
) -> list[Kill | BitFlip | Death]:
    """One fault of ``kind`` at ``step`` that leaves the job a way to survive: a live
    replica of every stage, or for a wiped stage a snapshot (CheckFree: its neighbours)."""
    stage, replica = draw(st.sampled_from(_workers(top)))
    at = draw(st.sampled_from(list(KillPoint)))
    if kind == "kill":
        return [Kill(step=step, stage=stage, replica=replica, at=at)]
    if kind == "flip":
        return [BitFlip(step=step, stage=stage, replica=replica, seed=draw(st.integers(0, 99)))]
    if kind == "wipe":
        wiped = draw(st.integers(0, top.stages - 1))
        return [Kill(step=step, stage=wiped, replica=r) for r in range(top.replicas)]
    first = Kill(step=step, stage=stage, replica=replica)
    others = [
        w for w in _workers(top) if w != (stage, replica) and (w[0] != stage or top.replicas > 2)
    ]
    if policy == "zero1":  # a second loss in the stage would take a shard with its mirror
        others = [w for w in others if w[0] != stage]
    if kind == "burst" or not others:
        if not others:
            return [first]
        second = draw(st.sampled_from(others))
        return [first, Kill(step=step, stage=second[0], replica=second[1], at=at)]
    method = draw(st.sampled_from(METHODS))
    if method in ("setup", "recv_state"):  # calls only the replacement gets
        victim = (stage, replica)
        if policy in ("zero1", "elastic"):  # (a shard comes in recv_shard; a shrink waits)
            method, victim = "join", draw(st.sampled_from(others))
    elif method == "send_state":  # the copy's source: the lowest live replica of the stage
        mates = [(stage, r) for r in range(top.replicas) if r != replica]
        victim = mates[0]
        if policy == "zero1" or (top.replicas == 2):  # (the only replica left: not survivable)
            method, victim = "join", draw(st.sampled_from(others))
    else:
        victim = draw(st.sampled_from(others))
    return [Death(first=first, victim=top.rank(*victim), method=method)]


# -- running a case ------------------------------------------------------------------------


_ORACLES: dict[tuple[str, Topology, bool, bool], Controller] = {}


def _make(case: Case, *scheduled: Any) -> tuple[Controller, Any]:
    return make(
        case.spec(),
        case.top,
        *scheduled,
        policy=case.recovery_policy(),
        nodes=2,
        steps=STEPS,
        eval_every=2 if case.evaluate else 0,
    )


def _oracle(case: Case) -> Controller:
    key = (case.model, case.top, case.policy == "zero1", case.evaluate)
    if key not in _ORACLES:
        controller, _ = _make(case)
        drive(controller)
        assert controller.phase is JobPhase.FINISHED, controller.error
        _ORACLES[key] = controller
    return _ORACLES[key]


def _run(case: Case) -> tuple[Controller, list[tuple[int, str]]]:
    scheduled = [f for f in case.faults if not isinstance(f, Death)]
    scheduled += [f.first for f in case.faults if isinstance(f, Death)]
    controller, group = _make(case, *scheduled)
    deaths = [f for f in case.faults if isinstance(f, Death)]
    fired: list[tuple[int, str]] = []
    lock = threading.Lock()

    def chaos(rank: int, method: str) -> float | None:
        failure = controller.failure
        if failure is None:  # only inside a recovery: the one its first kill started
            return None
        with lock:
            for death in deaths:
                hit = (death.victim, death.method)
                first = case.top.rank(death.first.stage, death.first.replica)
                own = first in failure.lost and failure.step == death.first.step
                if (rank, method) == hit and hit not in fired and own:
                    fired.append(hit)
                    return 0.0
        return None

    group.chaos = chaos
    flipped: set[str] = set()  # what each injected bit flip changed (`StageWorker.flipped`)
    controller.on_step = lambda record: flipped.update(
        w.worker.flipped for w in group._workers.values() if w.worker.flipped
    )
    drive(controller)
    controller.flipped = flipped  # type: ignore[attr-defined]
    return controller, fired


def _lost_workers(controller: Controller) -> set[tuple[int, int]]:
    return {tuple(w) for event in controller.events for w in event.lost}  # type: ignore[misc]


def check(case: Case) -> None:
    oracle = _oracle(case)
    started = time.monotonic()
    job, fired = _run(case)
    if os.environ.get("CHECKFREE_TIMINGS"):
        print(f"{time.monotonic() - started:6.2f} s  {case}", flush=True)
    assert job.phase is JobPhase.FINISHED, f"{case}: {job.error}"
    top = case.top
    # every fault fired where it was meant to
    for fault in case.faults:
        if isinstance(fault, Kill):
            assert (fault.stage, fault.replica) in _lost_workers(job), (case, job.events)
        elif isinstance(fault, BitFlip):  # it flipped a bit; the vote found it -- unless its
            # worker died first, or the next updates washed the bit out (checked below: exact)
            assert job.flipped, (case, "the flip never fired")  # type: ignore[attr-defined]
        else:
            assert (fault.victim, fault.method) in fired, (case, fired, job.events)
            victim = top.worker(fault.victim)
            assert (victim.stage, victim.replica) in _lost_workers(job), (case, job.events)
    strategies = "+".join(e.strategy for e in job.events)
    rebuilt = "neighbor_average" in strategies or "edge_copy" in strategies
    shrunk = "shrink" in strategies and top.replicas > 2
    states, want = job.final_states, oracle.final_states  # type: ignore[attr-defined]
    losses = final_trajectory(job.records)
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), case
    if rebuilt:
        for stage in range(top.stages):
            held = [states[key] for key in sorted(states) if key[0] == stage]
            for other in held[1:]:
                assert not differences(other, held[0]), (case, stage)
        marks = {Progress.from_dict(states[(s, 0)]["progress"]).rebuild for s in range(top.stages)}
        assert marks - {None}, (case, "a rebuilt stage must carry its mark")
        return
    rtol = STATE_RTOL if shrunk else 0.0
    found = differences(losses, final_trajectory(oracle.records), where="losses", rtol=rtol)
    found += differences(states, {k: v for k, v in want.items() if k in states}, rtol=rtol)
    assert not found, (str(case), found[:5])
    if shrunk:
        for stage in range(top.stages):
            held = [states[key] for key in sorted(states) if key[0] == stage]
            assert all(not differences(other, held[0]) for other in held[1:]), (case, stage)


def _settings(**kwargs: Any) -> Any:
    # No shrinking: a failing job's message names its whole case, and shrinking would rerun
    # hundreds of failing jobs, each leaving its threads behind in this process.
    common = dict(
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[Phase.generate],
        report_multiple_bugs=False,
    )
    if EXAMPLES:
        return settings(max_examples=EXAMPLES, **common, **kwargs)
    return settings(max_examples=CI_EXAMPLES, derandomize=True, **common, **kwargs)


@pytest.mark.timeout(0 if EXAMPLES else 600)
@_settings()
@given(cases())
def test_every_job_ends_where_the_failure_free_run_ends(case: Case) -> None:
    check(case)


@pytest.mark.parametrize(
    "case",
    [
        # a copy of a CheckFree-rebuilt stage (it used to kill the job)
        Case(
            "mlp", Topology(3, 2), "checkfree", False, 0,
            (
                Kill(step=2, stage=1, replica=0), Kill(step=2, stage=1, replica=1),
                Kill(step=3, stage=1, replica=0, at=KillPoint.MID_PIPELINE),
            ),
        ),
        # BatchNorm, dropout, evaluation, a kill mid-pipeline and a death while it forms
        Case(
            "bn-cnn", Topology(2, 3), "exact", True, 0,
            (Death(Kill(step=2, stage=0, replica=1, at=KillPoint.MID_PIPELINE), 3, "join"),),
        ),
        # a shrunk job of three replicas, a second death while shrinking
        Case(
            "transformer", Topology(2, 3), "elastic", True, 0,
            (Death(Kill(step=1, stage=1, replica=0), 2, "prepare_recovery"),),
        ),
        # ZeRO-1 with buffers: the shard and the stage's buffers from the mirror holder
        Case("bn-cnn", Topology(2, 2), "zero1", True, 1, (Kill(step=3, stage=1, replica=1),)),
        # a bit flipped: two replicas cannot tell who, so everyone rolls back
        Case("transformer", Topology(2, 2), "exact", False, 0, (BitFlip(step=2, stage=0, replica=1, seed=3),)),
    ],
    ids=["checkfree-copy", "bn-cnn-formation", "elastic-shrunk", "zero1-buffers", "flip"],
)  # fmt: skip
def test_named_cases(case: Case) -> None:
    """A few cases every run checks by name, whatever the random draw."""
    check(case)
