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
from recovery import RecoveryPolicy, Trainer
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


def _chaos(controller: Controller, second: str, log: list[str]) -> None:
    """Kill (1,0) after step 3; 0.5 s later, kill ``second``: the replacement of (1,0)
    (a new process, once it has one) or the survivor (0,1)."""
    deadline = time.monotonic() + 60
    while controller.step < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = TOP.rank(1, 0)
    first = _pid(controller, victim)
    os.kill(first, signal.SIGKILL)
    log.append(f"killed (1,0) pid {first}")
    time.sleep(0.5)
    if second == "survivor":
        target = _pid(controller, TOP.rank(0, 1))
        os.kill(target, signal.SIGKILL)
        log.append(f"killed (0,1) pid {target}")
        return
    while time.monotonic() < deadline:  # the replacement, as soon as its process exists
        with_pid = controller.infos().get(victim)
        if with_pid is not None and with_pid.pid != first:
            os.kill(with_pid.pid, signal.SIGKILL)
            log.append(f"killed the replacement of (1,0) pid {with_pid.pid}")
            return
        time.sleep(0.01)


@pytest.mark.parametrize("second", ["replacement", "survivor"])
def test_a_second_kill_during_the_first_recovery_ends_bit_identical(oracle, second: str) -> None:  # type: ignore[no-untyped-def]
    controller = Controller(
        mlp_spec(),
        TOP,
        ControllerConfig(backend="gloo"),
        policy=RecoveryPolicy(hot_spares=0, snapshot_every=None),
    )
    log: list[str] = []
    chaos = threading.Thread(target=_chaos, args=(controller, second, log), daemon=True)
    try:
        controller.start()
        chaos.start()
        controller.run(STEPS)
        states = controller.states()
    finally:
        chaos.join(timeout=60)
        controller.shutdown()
    assert len(log) == 2, log
    assert controller.phase is Phase.FINISHED
    lost = {w for event in controller.events for w in event.lost}
    assert (1, 0) in lost and (second == "replacement" or (0, 1) in lost), controller.events
    for key, state in oracle.items():
        for name, value in state["model"].items():
            assert torch.equal(states[key]["model"][name], value), (key, name, log)
