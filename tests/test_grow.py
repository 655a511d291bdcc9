"""Shrink and grow in a free-running `Trainer.fit` on a real multi-node Ray cluster.

A 2x2 job whose workers each ask for a CPU, on a head with no CPUs and two 2-CPU nodes:
nothing holds the controller between steps. One worker node is removed mid-run -- its
two workers are lost and there is no room for replacements, so the job shrinks and trains
on -- and a fresh node is added a few seconds later: the replacements asked for as spares
are placed there, warm up, and the job grows back at a step boundary. With two replicas
every loss and every final state is the run's that never failed, bit for bit.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from parallelism import Topology
from recovery import RecoveryPolicy, Trainer
from recovery.groups.ray_env import local_cluster
from recovery.reference import differences
from tests.workloads import mlp_spec

# Slow (2 x 900 steps on a cluster of its own): the default run has the same shrink and grow
# on a real multi-node cluster, driven step by step (tests/test_resources.py), and in a
# job on threads (tests/test_elastic.py).
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(600)]

STEPS = 900
TOP = Topology(2, 2)


@pytest.fixture
def cluster():  # type: ignore[no-untyped-def]
    """A head with no CPUs (it holds the driver, never a worker) and two 2-CPU nodes."""
    with local_cluster(2, worker_nodes=2, head_cpus=0) as made:
        yield made


def _trainer(policy: RecoveryPolicy | None = None) -> Trainer:
    return Trainer(mlp_spec(), topology=TOP, worker_resources={"CPU": 1}, policy=policy)


def test_a_node_lost_and_one_added_shrinks_then_grows_in_fit(cluster) -> None:  # type: ignore[no-untyped-def]
    c, nodes = cluster
    oracle = _trainer().fit(STEPS)  # the same cluster, nothing lost
    trainer = _trainer(RecoveryPolicy(elastic=True, hot_spares=0))
    out: dict[str, Any] = {}

    def fit() -> None:
        try:
            out["result"] = trainer.fit(STEPS)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    job = threading.Thread(target=fit, daemon=True)
    job.start()
    deadline = time.monotonic() + 120
    while not trainer.live_workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.0)  # training, free-running
    lost = sorted(c for c, i in trainer.live_workers().items() if i.node_id == nodes[0].node_id)
    c.remove_node(nodes[0])  # (Ray's node calls must come from the main thread)
    time.sleep(6.0)  # trains shrunk meanwhile
    c.add_node(num_cpus=2)
    job.join(timeout=400)
    assert not job.is_alive(), "fit did not end"
    assert "error" not in out, out.get("error")
    result = out["result"]
    strategies = [e.strategy for e in result.events]
    assert strategies[0] == "shrink" and sorted(result.events[0].lost) == lost, result.events
    assert strategies[-1].startswith("grow"), strategies
    grown = {w for e in result.events if "grow" in e.strategy for w in e.lost}
    assert grown == set(lost)  # every missing worker came back
    shrunk = result.events[0].step
    regrown = next(e.step for e in result.events if "grow" in e.strategy)
    assert regrown - shrunk >= 10, (shrunk, regrown)  # it really trained shrunk
    assert set(result.states) == {(s, r) for s in range(2) for r in range(2)}
    found = differences(result.losses, oracle.losses, where="losses")
    found += differences(result.states, oracle.states, where="states")
    assert not found, found[:5]
