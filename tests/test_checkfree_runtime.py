"""CheckFree and CheckFree+ on the Ray runtime: a stage with no live replica is rebuilt from
its neighbours, training goes on without a rollback."""

from __future__ import annotations

import functools

import pytest
import torch

from parallelism import Topology
from parallelism.workloads.llama_spec import llama_spec
from recovery import FitResult, Trainer, TrainSpec
from recovery.faults import FailureSchedule, Kill, KillPoint
from recovery.policy import RecoveryPolicy, SnapshotPolicy
from recovery.runtime import Controller, ControllerConfig, Phase
from recovery.strategies.checkfree import CheckFreeConfig, rebuild_stage
from simulations.convergence import ConvergenceSetup, PipelineTrainer
from tests.test_engine import WEIGHT_TOL

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

# What the in-process simulator trains: the same model, data and optimizer as `spec()`.
SETUP = ConvergenceSetup(
    preset="tiny", stages=4, microbatches=4, microbatch_size=2, seq_len=32, max_bytes=2_000_000
)
AFTER = 10
"""Steps trained after a rebuild before the runs are compared."""


@functools.cache
def spec(plus: bool = False) -> TrainSpec:
    return llama_spec(
        preset="tiny",
        seq_len=32,
        microbatch_size=2,
        microbatches=4,
        max_bytes=2_000_000,
        checkfree_plus=plus,
    )


def _in_process(
    stage: int, kill: int, *, plus: bool = False
) -> dict[str, tuple[list[float], list[dict[str, torch.Tensor]]]]:
    """The oracle runs in this process: ``kill`` steps, then ``stage`` rebuilt by CheckFree
    (``weighted``) or re-initialised (``random``), then `AFTER` more steps. Returns the
    losses and the final states of each."""
    trainer = PipelineTrainer(SETUP, plus=plus)
    prefix = [trainer.train_step(step) for step in range(kill)]
    snapshot = trainer.snapshot()
    runs = {}
    for averaging in ("weighted", "random"):
        trainer.restore(snapshot)
        trainer.rebuild([stage], CheckFreeConfig(averaging=averaging), step=kill, attempt=0)
        after = [trainer.train_step(step) for step in range(kill, kill + AFTER)]
        runs[averaging] = (prefix + after, trainer.states())
    return runs


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.allclose(a[k], b[k], rtol=WEIGHT_TOL["rtol"], atol=WEIGHT_TOL["atol"]) for k in a
    )


def assert_matches_the_oracle(result: FitResult, stage: int, kill: int, plus: bool) -> None:
    """The Ray run trained step for step as the in-process run that rebuilt ``stage`` the
    same way (losses and final weights), and a random re-initialisation would not have:
    a loss bound cannot tell the two apart at this scale (a re-initialised tiny stage is
    close to the identity; see test_convergence), the weights can."""
    runs = _in_process(stage, kill, plus=plus)
    losses, states = runs["weighted"]
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    for s, state in enumerate(states):
        for key, value in state.items():
            torch.testing.assert_close(result.state(s, 0)[key], value, **WEIGHT_TOL)
    assert not _close(runs["random"][1][stage], states[stage])  # the check above can fail


def test_pipeline_of_one_replica_loses_an_intermediate_stage() -> None:
    k = 10
    policy = RecoveryPolicy(approximate="checkfree", snapshots=SnapshotPolicy(peer_every=None))
    result = Trainer(
        spec(),
        topology=Topology(4, 1),
        policy=policy,
        failures=FailureSchedule([Kill(step=k, stage=2, replica=0)]),
    ).fit(k + AFTER)
    (event,) = result.events
    assert event.strategy == "neighbor_average" and event.lost_steps == 0 and event.tier is None
    assert [tuple(s) for s in event.actions[0]["sources"]] == [(1, 0), (3, 0)]
    assert_matches_the_oracle(result, 2, k, plus=False)


def test_the_oracle_rebuilds_by_the_published_formula() -> None:
    """The oracle's rebuilt stage is the formula of the paper, written out here: stage i
    becomes (a W_{i+1} + b W_{i-1}) / (a + b), a = |g_{i+1}| + 1e-4, b = |g_{i-1}| + 1e-4;
    CheckFree+'s lost first stage becomes a copy of stage 1."""
    k = 10
    trainer = PipelineTrainer(SETUP)
    for step in range(k):
        trainer.train_step(step)
    before = trainer.states()
    prev_norm, next_norm = trainer.tracker.neighbours(2)
    assert prev_norm is not None and next_norm is not None and prev_norm != next_norm
    trainer.rebuild([2], CheckFreeConfig(), step=k, attempt=0)
    a, b = next_norm + 1e-4, prev_norm + 1e-4
    for key, value in trainer.states()[2].items():
        expected = (a * before[3][key].double() + b * before[1][key].double()) / (a + b)
        torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-7, msg=key)
    plus = PipelineTrainer(SETUP, plus=True)
    for step in range(k):
        plus.train_step(step)
    before = plus.states()
    plus.rebuild([0], CheckFreeConfig(), step=k, attempt=0)
    rebuilt = plus.states()[0]
    assert rebuilt.keys() <= before[1].keys()
    for key, value in rebuilt.items():
        assert torch.equal(value, before[1][key]), key


def test_checkfree_plus_rebuilds_the_first_stage_from_its_swap_partner() -> None:
    k = 10
    policy = RecoveryPolicy(approximate="checkfree+", snapshots=SnapshotPolicy(peer_every=None))
    fault = Kill(step=k, stage=0, replica=0, at=KillPoint.MID_PIPELINE)
    result = Trainer(
        spec(plus=True), topology=Topology(4, 1), policy=policy, failures=FailureSchedule([fault])
    ).fit(k + AFTER)
    (event,) = result.events
    assert event.strategy == "edge_copy" and [tuple(s) for s in event.actions[0]["sources"]] == [
        (1, 0)
    ]
    assert_matches_the_oracle(result, 0, k, plus=True)
    # the (de)embedding replicas stayed bit-identical through training and the rebuild
    assert torch.equal(
        result.state(0, 0)["tok_embeddings.weight"], result.state(1, 0)["tok_embeddings.weight"]
    )
    for key in ("norm.weight", "output.weight"):
        assert torch.equal(result.state(2, 0)[key], result.state(3, 0)[key])


@pytest.mark.slow  # on threads in the default run: test_exact_everywhere's checkfree-copy
def test_a_whole_stage_group_lost_in_a_4x2_job_recovers_without_rollback() -> None:
    policy = RecoveryPolicy(
        approximate="checkfree", exact_only=False, snapshots=SnapshotPolicy(peer_every=3)
    )
    # Both die before their first forward: a later kill point races the abort the first
    # death triggers, and the survivor would be rebuilt exactly instead (a different test).
    faults = [Kill(step=6, stage=1, replica=0), Kill(step=6, stage=1, replica=1)]
    result = Trainer(
        spec(), topology=Topology(4, 2), policy=policy, failures=FailureSchedule(faults)
    ).fit(12)
    (event,) = result.events
    assert event.strategy == "neighbor_average" and event.tier is None and event.lost_steps == 0
    for s in range(4):  # the rebuilt stage was rebuilt identically on both replicas
        for k, v in result.state(s, 0).items():
            assert torch.equal(v, result.state(s, 1)[k]), (s, k)


@pytest.mark.slow  # the plans: tests/test_planner.py; the rollback on threads: test_controller
def test_exact_only_or_no_approximation_rolls_back_instead() -> None:
    faults = [Kill(step=6, stage=1, replica=0), Kill(step=6, stage=1, replica=1)]
    for policy in (
        RecoveryPolicy(
            approximate="checkfree", exact_only=True, snapshots=SnapshotPolicy(peer_every=3)
        ),
        RecoveryPolicy(approximate=None, snapshots=SnapshotPolicy(peer_every=3)),
    ):
        result = Trainer(
            spec(), topology=Topology(4, 2), policy=policy, failures=FailureSchedule(faults)
        ).fit(8)
        assert [e.strategy for e in result.events] == ["rollback"]


def test_the_runtime_rebuilds_exactly_what_the_pure_function_computes() -> None:
    """The Ray runtime and the in-process simulator share `rebuild_stage`: given the live
    neighbours' states and norms, the rebuilt worker holds exactly its result."""
    k = 5
    policy = RecoveryPolicy(approximate="checkfree", snapshots=SnapshotPolicy(peer_every=None))
    controller = Controller(
        spec(), Topology(4, 1), ControllerConfig(backend="gloo"), policy=policy,
        failures=FailureSchedule([Kill(step=k, stage=2, replica=0)]),
    )  # fmt: skip
    try:
        controller.start()
        controller.target_steps = k + 2
        while controller.step < k:
            controller.advance()
        norms = list(controller.ledger.grad_norms.norms)
        phases = [controller.advance()]
        while phases[-1] is not Phase.RUNNING:
            phases.append(controller.advance())
        assert phases == [
            Phase.RECOVERING,
            Phase.REPLACING,
            Phase.REFORMING,
            Phase.RESTORING,
            Phase.RUNNING,
        ]
        assert controller.step == k and controller.ledger.grad_norms.norms[2] is None
        states = controller.states()
    finally:
        controller.shutdown()
    expected = rebuild_stage(
        CheckFreeConfig(),
        stage=2,
        num_stages=4,
        template=dict(spec().build(2, 4).state_dict()),
        prev=states[(1, 0)]["model"],
        nxt=states[(3, 0)]["model"],
        prev_norm=norms[1],
        next_norm=norms[3],
    )
    assert expected.method == "neighbor_average" and expected.weights != (0.5, 0.5)
    for key, value in expected.state.items():
        assert torch.equal(states[(2, 0)]["model"][key], value), key
    assert states[(2, 0)]["optimizer"]["state"] == {}  # a fresh optimizer (published method)


def test_swapped_routes_without_failures_match_the_in_process_oracle() -> None:
    steps = 6
    ray_run = Trainer(spec(plus=True), topology=Topology(4, 1)).fit(steps)
    oracle = PipelineTrainer(SETUP, plus=True)
    losses = [oracle.train_step(step) for step in range(steps)]
    torch.testing.assert_close(
        torch.tensor(ray_run.losses), torch.tensor(losses), rtol=1e-5, atol=0
    )
    for s, state in enumerate(oracle.states()):
        for key, value in state.items():
            torch.testing.assert_close(ray_run.state(s, 0)[key], value, **WEIGHT_TOL)


def test_checkfree_plus_needs_a_model_trained_for_it() -> None:
    with pytest.raises(ValueError, match="checkfree_plus=True"):
        Trainer(spec(), topology=Topology(4, 1), policy=RecoveryPolicy(approximate="checkfree+"))
    with pytest.raises(ValueError, match="at least 4 stages"):
        Trainer(spec(plus=True), topology=Topology(3, 1)).fit(1)
