"""Buffers are state, evaluation leaves no trace, and every stage draws the same samples.

[Note: buffers are state] in parallelism/buffers.py, `StageWorker.evaluate` and [Note: one
draw for every stage] in recovery/worker/stage.py. The pure parts first, then whole jobs of
a CNN with BatchNorm and dropout on the thread worker group, each against the run that
never failed (or never evaluated), bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from parallelism import Topology
from parallelism.buffers import StageBuffers, evaluating, persistent_buffers
from parallelism.seeding import Randomness, ThreadRandomness
from recovery import Kill, KillPoint, batches_from_dataset
from recovery.reference import differences
from recovery.runtime import Phase
from recovery.worker import StageWorker
from tests.jobs import drive, make
from tests.workloads import MaskedPairs, bn_cnn_spec, mlp_spec

TOP = Topology(2, 2)
STEPS = 6


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buf.detach().clone() for name, buf in persistent_buffers(module)}


# -- the pure parts ------------------------------------------------------------------------


def test_a_steps_buffers_wait_for_the_commit_and_an_abandoned_step_leaves_none() -> None:
    torch.manual_seed(0)
    bn, x = nn.BatchNorm1d(4), torch.randn(8, 4)
    plain = nn.BatchNorm1d(4)
    plain(x)  # what one forward pass makes of the buffers
    buffers = StageBuffers(bn, replicas=1)
    committed = _values(bn)
    buffers.begin()
    bn(x)
    buffers.collect()
    assert not differences(_values(bn), committed)  # the committed values are back
    buffers.finish(None, buffers.reduce(None))
    assert not differences(_values(bn), committed)  # still pending
    buffers.apply()
    assert not differences(_values(bn), _values(plain))  # the commit writes them
    committed = _values(bn)
    buffers.begin()
    bn(x)  # a step abandoned after a forward pass
    buffers.drop()
    assert not differences(_values(bn), committed)


def test_the_average_keeps_a_constant_buffer_bit_exact_and_a_counter_an_integer() -> None:
    """Three shares (three replicas' worth) of a constant table and a BatchNorm: float64
    sums keep 0.1 (not a binary fraction) exact, and the counter stays an integer."""
    module = nn.Sequential(nn.BatchNorm1d(3))
    module.register_buffer("table", torch.full((5,), 0.1))
    buffers = StageBuffers(module, replicas=3)
    buffers.begin()
    for seed in range(3):
        torch.manual_seed(seed)
        module(torch.randn(6, 3))
        buffers.collect()
    buffers.finish(None, buffers.reduce(None))
    buffers.apply()
    assert torch.equal(module.table, torch.full((5,), 0.1))
    counter = module[0].num_batches_tracked
    assert counter.dtype == torch.int64 and int(counter) == 1


@pytest.mark.parametrize("rng", [Randomness(), ThreadRandomness()], ids=["process", "thread"])
def test_evaluating_gives_back_modes_buffers_and_random_streams(rng: Randomness) -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1  # a module that changes a buffer even in eval mode
            return self.drop(x) + torch.rand_like(x)

    module = nn.Sequential(Counting(), nn.BatchNorm1d(4))
    module[1].eval()  # a user's choice: it stays in eval mode after
    x = torch.randn(5, 4)
    rng.seed(3)
    with rng.compute():
        expected = torch.rand(3)
    rng.seed(3)
    with rng.kept(), evaluating(module), rng.compute():  # as StageWorker.evaluate
        assert not module.training and not module[0].drop.training
        module(x)
    assert module.training and module[0].training and not module[1].training
    assert float(module[0].calls) == 0.0
    with rng.compute():
        assert torch.equal(torch.rand(3), expected)  # the stream evaluation drew from is back


def test_the_first_and_the_last_stage_draw_the_same_samples() -> None:
    """A dataset masks at random from torch's global generator; the first stage reads the
    inputs, the last the targets, in two processes whose generators hold different
    states: each input must still come with its own mask."""
    spec = mlp_spec(batches=batches_from_dataset(MaskedPairs(), 8))
    top = Topology(2, 1)
    first, last = StageWorker(), StageWorker()
    first.setup(spec, top, top.rank(0, 0), "gloo")
    last.setup(spec, top, top.rank(1, 0), "gloo")
    for step in range(4):
        torch.manual_seed(step)
        expected = torch.rand(2)
        torch.manual_seed(step)
        inputs, _ = first._data(spec.batches, step, first.schedule)
        assert torch.equal(torch.rand(2), expected)  # the step's own stream is untouched
        torch.manual_seed(1_000 + step)
        _, targets = last._data(spec.batches, step, last.schedule)
        for x, mask in zip(inputs, targets, strict=True):
            assert torch.equal((x != 0).float(), mask), step


# -- whole jobs ----------------------------------------------------------------------------


def _run(*faults: object, eval_every: int = 0, top: Topology = TOP):  # type: ignore[no-untyped-def]
    controller, _ = make(bn_cnn_spec(), top, *faults, steps=STEPS, eval_every=eval_every)
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    return controller


@pytest.fixture(scope="module")
def clean():  # type: ignore[no-untyped-def]
    return _run()


def test_replicas_hold_bit_identical_buffers_and_the_buffers_train(clean) -> None:  # type: ignore[no-untyped-def]
    states = clean.final_states
    for stage in range(TOP.stages):
        ours, theirs = states[(stage, 0)], states[(stage, 1)]
        assert not differences(ours, theirs, where=f"stage {stage}")
        start = bn_cnn_spec().build(stage, TOP.stages).state_dict()
        moved = [k for k in start if "running" in k and not torch.equal(start[k], ours["model"][k])]
        assert moved, "the BatchNorm statistics never moved"


def test_a_job_that_evaluates_ends_bit_identical_to_one_that_does_not(clean) -> None:  # type: ignore[no-untyped-def]
    evaluated = _run(eval_every=2)
    assert [r.val_loss is not None for r in evaluated.records] == [
        (r.step + 1) % 2 == 0 for r in evaluated.records
    ]
    assert [r.loss for r in evaluated.records] == [r.loss for r in clean.records]
    found = differences(evaluated.final_states, clean.final_states)
    assert not found, found[:5]


def test_the_validation_loss_is_an_eval_mode_loss(clean) -> None:  # type: ignore[no-untyped-def]
    """The held-out loss the job reports is that of its final weights in eval mode (no
    dropout, BatchNorm on its running statistics), computed here in one process."""
    job = _run(eval_every=STEPS)
    reported = job.records[-1].val_loss
    spec = bn_cnn_spec()
    stages = []
    for stage in range(TOP.stages):
        module = spec.build(stage, TOP.stages)
        module.load_state_dict(job.final_states[(stage, 0)]["model"])
        stages.append(module.eval())
    losses = []
    with torch.no_grad():
        for replica in range(TOP.replicas):
            batch = spec.val_batches(0, replica, TOP.replicas)  # type: ignore[misc]
            for x, y in zip(*spec.split(batch, step=0, replica=replica), strict=True):
                for module in stages:
                    x = module(x)
                losses.append(float(spec.loss_fn(x, y)))
    assert reported is not None and math.isfinite(reported)
    assert reported == pytest.approx(sum(losses) / len(losses), rel=1e-6)


@pytest.mark.parametrize(
    "at", [KillPoint.MID_PIPELINE, KillPoint.DURING_ALLREDUCE, KillPoint.AFTER_COMMIT], ids=str
)
def test_a_kill_ends_bit_identical_buffers_included(clean, at: KillPoint) -> None:  # type: ignore[no-untyped-def]
    """(0,1) dies inside step 3: the survivors ran some (or all) of its forward passes, and
    the replacement is copied from (0,0). Every buffer of every worker ends as in the run
    that never failed."""
    job = _run(Kill(step=3, stage=0, replica=1, at=at), eval_every=3)
    (event,) = job.events
    assert event.lost == [(0, 1)] and event.strategy == "replica_copy"
    found = differences(job.final_states, clean.final_states)
    assert not found, found[:5]
