"""Kills the library does not schedule: SIGKILL of worker processes from outside, on Ray.

A chaos thread kills a worker process at a wall-clock time the controller knows nothing
about, then a second one while the first recovery is still running (no hot spare, so the
replacement takes seconds to start): the replacement itself, or a survivor. The oracle is
the run that never failed, bit for bit.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from parallelism import Topology
from recovery import RecoveryPolicy, SnapshotPolicy, Trainer
from recovery.reference import differences
from recovery.runtime import Controller, ControllerConfig, Phase
from tests.workloads import mlp_spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

TOP = Topology(2, 3)
STEPS = 14


@pytest.fixture(scope="module")
def oracle() -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    return Trainer(mlp_spec(), topology=TOP).fit(STEPS).states


def _pid(controller: Controller, rank: int) -> int:
    return controller.infos()[rank].pid


_RECOVERING = (Phase.RECOVERING, Phase.REPLACING, Phase.REFORMING, Phase.RESTORING)


def _chaos(controller: Controller, second: str, log: list[str], seen: list[int]) -> None:
    """Kill (1,0) after step 3; 0.4 s later, kill ``second``: the replacement of (1,0) (a
    new process, once it has one) or the survivor (0,1). Notes in ``log`` the phase each
    second kill landed in, and in ``seen`` every pid (1,0) has had since."""
    deadline = time.monotonic() + 60
    while controller.step < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = TOP.rank(1, 0)
    first = _pid(controller, victim)
    os.kill(first, signal.SIGKILL)
    log.append(f"killed (1,0) pid {first}")
    killed_at = time.monotonic()
    if second == "survivor":
        time.sleep(0.4)
        target = _pid(controller, TOP.rank(0, 1))
        phase = controller.phase
        os.kill(target, signal.SIGKILL)
        log.append(f"killed (0,1) pid {target} in {phase.value}")
    while time.monotonic() < deadline:  # the replacement, as soon as its process exists
        with_pid = controller.infos().get(victim)
        if with_pid is not None and with_pid.pid != first and with_pid.pid not in seen:
            seen.append(with_pid.pid)
            if second == "replacement":
                phase = controller.phase
                os.kill(with_pid.pid, signal.SIGKILL)
                log.append(f"killed the replacement of (1,0) pid {with_pid.pid} in {phase.value}")
                return
        if controller.phase is Phase.RUNNING and time.monotonic() > killed_at + 1:
            return
        time.sleep(0.01)


def _run(second: str, policy: RecoveryPolicy) -> tuple[Controller, list[str], list[int], dict]:  # type: ignore[type-arg]
    controller = Controller(mlp_spec(), TOP, ControllerConfig(backend="gloo"), policy=policy)
    log: list[str] = []
    seen: list[int] = []
    chaos = threading.Thread(target=_chaos, args=(controller, second, log, seen), daemon=True)
    try:
        controller.start()
        before = controller.infos()
        chaos.start()
        controller.run(STEPS)
        infos = controller.infos()
        states = controller.states()
    finally:
        chaos.join(timeout=60)
        controller.shutdown()
    return controller, log, seen, {"before": before, "infos": infos, "states": states}


@pytest.mark.parametrize("second", ["replacement", "survivor"])
def test_a_second_kill_during_the_first_recovery_ends_bit_identical(oracle, second: str) -> None:  # type: ignore[no-untyped-def]
    controller, log, _, end = _run(
        second, RecoveryPolicy(hot_spares=0, snapshots=SnapshotPolicy(peer_every=None))
    )
    assert len(log) == 2, log
    assert any(p.value in log[1] for p in _RECOVERING), log  # it landed in the recovery
    assert controller.phase is Phase.FINISHED
    (event,) = controller.events  # one recovery, interrupted by the second death
    assert event.interruptions, event
    lost = set(event.lost)
    assert (1, 0) in lost and (second == "replacement" or (0, 1) in lost), controller.events
    assert not differences(end["states"], oracle), log


def test_a_death_while_the_next_generation_forms_keeps_the_live_workers(oracle) -> None:  # type: ignore[no-untyped-def]
    """Peer snapshots only, no durable tier, no spare: (0,1) dies while (1,0)'s replacement
    starts, so the formation that follows fails. No live worker is thrown away for it: the
    other survivors keep their processes, and (1,0)'s replacement is kept and set up afresh
    (one process for it in all) rather than killed and started again."""
    survivors = [r for r in range(TOP.world_size) if r not in (TOP.rank(1, 0), TOP.rank(0, 1))]
    controller, log, seen, end = _run(
        "survivor", RecoveryPolicy(hot_spares=0, snapshots=SnapshotPolicy(peer_every=5))
    )
    assert len(log) == 2 and "replacing" in log[1], log
    (event,) = controller.events
    assert [note.split(":")[0] for note in event.interruptions] == ["reforming"], event
    assert sorted(event.lost) == [(0, 1), (1, 0)]
    assert len(seen) == 1 and end["infos"][TOP.rank(1, 0)].pid == seen[0], (seen, log)
    assert [end["infos"][r].pid for r in survivors] == [end["before"][r].pid for r in survivors]
    assert not differences(end["states"], oracle), log
