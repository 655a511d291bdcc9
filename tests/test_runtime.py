"""The Ray runtime end to end: actors, process groups, two-phase steps, results."""

from __future__ import annotations

import json

import pytest
import torch

from parallelism import Topology
from recovery import Trainer
from recovery.reference import train_reference
from recovery.runtime import Controller, ControllerConfig, Phase
from tests.test_engine import LOSS_RTOL, WEIGHT_TOL
from tests.workloads import mlp_spec, tiny_llama

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_4x2_on_ray_equals_single_process_training(schedule: str) -> None:
    spec = tiny_llama(schedule=schedule)
    steps = 8
    result = Trainer(spec, topology=Topology(4, 2)).fit(steps)
    ref = train_reference(spec, stages=4, replicas=2, steps=steps)
    assert len(result.losses) == steps
    torch.testing.assert_close(
        torch.tensor(result.losses, dtype=torch.float64),
        torch.tensor(ref.losses, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
    for s in range(4):
        for r in range(2):
            for k, v in ref.state(s).items():
                torch.testing.assert_close(result.state(s, r)[k], v, **WEIGHT_TOL)
    assert result.events == []


def test_same_seed_is_bit_identical_and_regenerations_change_nothing() -> None:
    """Determinism, and the process-group lifecycle: re-forming every other step is invisible."""
    spec = mlp_spec()
    top = Topology(3, 2)
    plain = Trainer(spec, topology=top).fit(6)

    controller = Controller(spec, top, ControllerConfig(backend="gloo"))
    try:
        controller.start()
        controller.target_steps = 6
        assert controller.phase is Phase.RUNNING and controller.generation == 0
        # One step a call and nothing sent ahead, so that no call is in flight at a
        # re-forming (test_engine.test_reformed_generation_continues_identically).
        assert controller.runner is not None
        controller.runner.may_pipeline = lambda nxt: False  # type: ignore[method-assign]
        while controller.advance() is Phase.RUNNING:
            if controller.step % 2 == 0:
                controller.members.form_generation()
        assert controller.phase is Phase.FINISHED
        assert controller.generation == 3
        states = controller.states()
        losses = [r.loss for r in controller.records]
    finally:
        controller.shutdown()
    assert losses == plain.losses
    for (s, r), state in states.items():
        for k, v in state["model"].items():
            assert torch.equal(v, plain.state(s, r)[k]), (s, r, k)
        opt_a, opt_b = state["optimizer"]["state"], plain.optimizer_state(s, r)["state"]
        for idx in opt_b:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt_a[idx][key], opt_b[idx][key])


def test_run_folder_and_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_llama()
    result = Trainer(
        spec, topology=Topology(2, 1), run_dir=tmp_path / "run", eval_every=3, collect_states=False
    ).fit(6)
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(6))
    assert all(m["loss"] > 0 and m["tokens_per_s"] > 0 for m in metrics)
    assert [step for step, _ in result.val_losses] == [3, 6]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_loss"] == pytest.approx(result.losses[-1])
    assert json.loads((run / "config.json").read_text())["topology"] == {"stages": 2, "replicas": 1}
    assert (run / "loss.png").stat().st_size > 10_000
    with pytest.raises(KeyError):
        result.state(0, 0)  # not collected
