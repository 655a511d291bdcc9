"""Node loss on a multi-node Ray cluster: replicas of a stage live on different nodes, so
losing a whole node leaves a live replica of every stage and training stays exact."""

from __future__ import annotations

import pytest
import torch

from parallelism import Topology
from recovery import RecoveryPolicy, Trainer
from recovery.runtime import Controller, ControllerConfig, Phase
from tests.jobs import ray_cluster
from tests.workloads import mlp_spec

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.fixture
def cluster():  # type: ignore[no-untyped-def]
    yield from ray_cluster(cpus_per_node=1)


def test_losing_a_node_keeps_training_exact(cluster) -> None:  # type: ignore[no-untyped-def]
    """With train.py's default of one hot spare: the spare is never used to put two
    replicas of a stage on one node, and a spare lost with its node is not waited for."""
    c, worker_nodes = cluster
    # Steps enough that the node's loss lands while the job trains: the workers commit
    # several steps a call once steps are fast, so 6 could be done before the node is gone.
    spec, top, steps = mlp_spec(), Topology(2, 3), 40
    oracle = Trainer(spec, topology=top).fit(steps)

    policy = RecoveryPolicy(hot_spares=1)
    controller = Controller(spec, top, ControllerConfig(backend="gloo"), policy=policy)
    try:
        controller.start()
        controller.target_steps = steps
        nodes = {i.node_id for i in controller.infos().values()}
        assert len(nodes) == 3  # three pipelines, one per node
        for s in range(top.stages):  # replicas of a stage on different nodes
            assert len({controller.infos()[r].node_id for r in top.stage_group(s)}) == 3
        while controller.step < 3:
            controller.advance()
        victim = next(n for n in worker_nodes if n.node_id in nodes)
        doomed = sorted(r for r, i in controller.infos().items() if i.node_id == victim.node_id)
        c.remove_node(victim)
        while controller.advance() not in (Phase.FINISHED, Phase.FAILED):
            pass
        assert controller.phase is Phase.FINISHED, controller.error
        (event,) = controller.events
        assert sorted(top.rank(s, r) for s, r in event.lost) == doomed
        assert all(i.node_id != victim.node_id for i in controller.infos().values())
        for s in range(top.stages):  # 2 nodes left: the 3 replicas of a stage on both
            assert len({controller.infos()[r].node_id for r in top.stage_group(s)}) == 2
        states = controller.states()
        losses = [r.loss for r in controller.records]
    finally:
        controller.shutdown()
    assert losses == oracle.losses
    for key, state in states.items():
        for k, v in state["model"].items():
            assert torch.equal(v, oracle.state(*key)[k])
