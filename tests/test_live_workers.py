"""A live worker is never discarded ([Note: live workers are kept] in
recovery/runtime/controller.py), and a stage's replicas stand in for each other's snapshots.

On the thread worker group: a death while a generation forms breaks every other joiner's
call, and none of them is lost for it -- the survivors keep their workers and their state,
and the replacement the interrupted recovery started is set up afresh, not started again.
An abort that overtakes the join it is meant for still gives that generation up. And a
stage whose every replica died comes back from any replica's snapshot, with no durable tier.
"""

from __future__ import annotations

import threading
import time

import pytest

from parallelism import Topology
from parallelism.comm import Rendezvous
from parallelism.comm.rendezvous import host_store
from recovery import Kill, RecoveryPolicy, SnapshotPolicy
from recovery.runtime import Phase
from recovery.worker import StageWorker, is_comm_error
from tests.jobs import drive, make
from tests.test_controller import assert_equal_states
from tests.test_reentrant import FIRST, LOST, SURVIVOR, TOP, once
from tests.workloads import mlp_spec

PEER_ONLY = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=2), hot_spares=0)
"""Peer snapshots, no durable tier, no spare: what must survive here does so by the live
workers alone."""


@pytest.fixture(scope="module")
def oracle():  # type: ignore[no-untyped-def]
    controller, _ = make(mlp_spec(), TOP, policy=PEER_ONLY)
    drive(controller)
    return controller.final_states  # type: ignore[attr-defined]


@pytest.mark.parametrize("victim", [SURVIVOR, LOST], ids=["a survivor", "the replacement"])
def test_a_death_while_the_generation_forms_keeps_every_live_worker(oracle, victim: int) -> None:  # type: ignore[no-untyped-def]
    """(1,0) dies at step 2; while the next generation forms, ``victim`` dies in its join.
    Every other joiner's join breaks: they keep their workers (the same objects) and their
    state, the replacement of (1,0) -- if it lives -- is set up afresh rather than started
    again, and the job ends bit-identical to the run that never failed."""
    controller, group = make(mlp_spec(), TOP, FIRST, policy=PEER_ONLY, nodes=3)
    before = {rank: group._workers[rank].worker for rank in range(TOP.world_size)}
    fired: list[str] = []
    rule = once(victim, "join")

    def chaos(rank: int, method: str) -> float | None:
        # only the recovery's formation: generation 0 formed in `make`, before the rule
        delay = rule(rank, method)
        if delay is not None:
            fired.append(f"{rank}:{method}")
        return delay

    group.chaos = chaos
    after: dict[int, object] = {}
    controller.on_step = lambda record: after.update(
        {rank: w.worker for rank, w in group._workers.items()}
    )
    drive(controller)
    assert fired == [f"{victim}:join"]
    assert controller.phase is Phase.FINISHED, controller.error
    (event,) = controller.events
    assert [note.split(":")[0] for note in event.interruptions] == ["reforming"]
    assert sorted(event.lost) == sorted(
        {(TOP.worker(r).stage, TOP.worker(r).replica) for r in (LOST, victim)}
    )
    kept = set(range(TOP.world_size)) - {LOST, victim}
    assert all(after[rank] is before[rank] for rank in kept), "a live survivor was replaced"
    # 6 workers at the start, then one replacement per dead rank: the replacement of (1,0)
    # started in the first attempt is kept (when it lives), not started again.
    assert group.started == TOP.world_size + 2
    assert_equal_states(controller.final_states, oracle)  # type: ignore[attr-defined]


def test_an_abort_that_overtakes_the_join_gives_that_generation_up() -> None:
    worker = StageWorker()
    worker.setup(mlp_spec(), Topology(2, 1), 0, "gloo")
    worker.abort(generation=4)  # the controller gave generation 4 up before its join began
    nowhere = Rendezvous("127.0.0.1", 1, "gen4", 60.0)  # never dialled
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="abandoned") as info:
        worker.join(4, nowhere, "127.0.0.1")
    assert time.monotonic() - started < 5.0 and is_comm_error(info.value)  # not the 60 s
    worker.joining, worker.forming = 5, threading.Event()
    worker.abort(generation=4)  # an abort of 4 arriving late, while 5 forms: 5 goes on
    assert not worker.forming.is_set()
    worker.abort(generation=5)
    assert worker.forming.is_set()


def test_an_abort_of_an_ended_job_does_not_give_up_the_next_jobs_generation() -> None:
    # A formation failed; the controller's aborts were on their way when that job ended and
    # its worker was reset and parked. Taken by the next job, the worker must still join
    # that job's generation 0 (found by clean-ci: a whole job failed to start, every rank
    # reporting "gloo group formation abandoned").
    worker = StageWorker()
    worker.setup(mlp_spec(), Topology(2, 1), 0, "gloo")
    ended = Rendezvous("127.0.0.1", 1, "gen0", 60.0, job="ended")
    worker.abort(generation=0, job="ended")
    with pytest.raises(RuntimeError, match="abandoned"):
        worker.join(0, ended, "127.0.0.1")
    worker.reset()
    worker.abort(generation=0, job="ended")  # a second one, arriving after the reset
    worker.setup(mlp_spec(), Topology(1, 1), 0, "gloo")
    store = host_store("127.0.0.1")
    worker.join(0, Rendezvous("127.0.0.1", store.port, "gen0", 20.0, job="next"), "127.0.0.1")
    assert worker.comm is not None and worker.generation == 0
    worker.abort(generation=0, job="ended")  # nor does a late one touch the joined groups
    assert worker.comm is not None
    worker.reset()


def _stage_wiped_and_a_buddy(top: Topology) -> tuple[list[Kill], dict[int, int]]:
    """Kills that take every replica of stage 0 and the buddy holding (0,1)'s snapshot, so
    that (0,1)'s own snapshot is gone while (0,0)'s survives on its buddy."""
    controller, _ = make(mlp_spec(), top, policy=PEER_ONLY, nodes=2)
    ring = dict(controller.ledger.ring)  # rank -> the rank that holds its snapshot
    controller.shutdown()
    mine, theirs = top.rank(0, 1), top.rank(0, 0)
    buddy = ring[mine]
    assert buddy != ring[theirs] and top.worker(buddy).stage != 0, ring
    kills = [Kill(step=3, stage=0, replica=0), Kill(step=3, stage=0, replica=1)]
    kills.append(Kill(step=3, stage=top.worker(buddy).stage, replica=top.worker(buddy).replica))
    return kills, ring


def test_a_stage_with_no_replica_left_comes_back_from_any_replicas_snapshot() -> None:
    """2x2 with peer snapshots every 2 steps and no durable tier: stage 0 loses both
    replicas, and the buddy holding (0,1)'s snapshot dies with them. (0,0)'s snapshot of
    step 2 is still held by its buddy; the replicas of a stage are bit-identical, so it
    restores (0,1) too, and everyone rolls back to step 2 -- ending bit-identical."""
    top = Topology(2, 2)
    clean, _ = make(mlp_spec(), top, policy=PEER_ONLY, nodes=2)
    drive(clean)
    kills, ring = _stage_wiped_and_a_buddy(top)
    controller, _ = make(mlp_spec(), top, *kills, policy=PEER_ONLY, nodes=2)
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    (event,) = controller.events
    assert event.strategy == "rollback" and event.tier == "peer" and event.step == 3
    assert event.lost_steps == 1  # back to the snapshot of step 2
    restored = {tuple(a["worker"]): a["sources"] for a in event.actions}
    holder = top.worker(ring[top.rank(0, 0)])  # holds (0,0)'s snapshot: (0,1) takes it
    assert [tuple(s) for s in restored[(0, 1)]] == [(holder.stage, holder.replica)]
    assert_equal_states(controller.final_states, clean.final_states)  # type: ignore[attr-defined]
