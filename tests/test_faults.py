from __future__ import annotations

import pytest

from parallelism import Topology
from recovery import Trainer
from recovery.faults import FailureSchedule, Hang, Kill, KillNode, KillPoint
from tests.workloads import mlp_spec


def test_parse_round_trips_and_defaults() -> None:
    top = Topology(4, 2)
    text = "kill:step=20,stage=1,replica=0;kill:step=3,stage=2,replica=1,at=during_allreduce;hang:step=5,stage=0,replica=1;killnode:step=7,node=1"
    schedule = FailureSchedule.parse(text, topology=top, steps=30)
    assert list(schedule) == [
        Kill(step=20, stage=1, replica=0),
        Kill(step=3, stage=2, replica=1, at=KillPoint.DURING_ALLREDUCE),
        Hang(step=5, stage=0, replica=1),
        KillNode(step=7, node=1),
    ]
    again = FailureSchedule.parse(str(schedule), topology=top, steps=30)
    assert list(again) == list(schedule)
    assert len(FailureSchedule.parse("none", topology=top, steps=30)) == 0


def test_poisson_is_deterministic_and_scales_with_rate() -> None:
    top = Topology(4, 2)
    a = FailureSchedule.poisson(top, 200, 0.01, seed=3)
    b = FailureSchedule.parse("poisson:rate=0.01,seed=3", topology=top, steps=200)
    assert list(a) == list(b) and len(a) > 0
    assert len(FailureSchedule.poisson(top, 200, 0.05, seed=3)) > len(a)
    assert all(isinstance(f, Kill) and f.step < 200 for f in a)


@pytest.mark.parametrize(
    "text, message",
    [
        ("explode:step=1", "unknown fault kind 'explode'"),
        ("kill:step=1", "needs a value for 'stage'"),
        ("kill:step=1,stage=0,color=red", "unknown field"),
        ("kill:step=x,stage=0", "malformed value"),
        ("kill:step=1,stage=0,at=lunch", "unknown kill point 'lunch'"),
        ("kill:step=1,stage=9", "outside a 4x2 job"),
        ("kill:step=99,stage=0", "outside a job of 30 steps"),
        ("poisson:rate=2", "must be a probability"),
        ("kill step=1", "unknown fault kind"),
        ("kill:step=1,stage=0,step=5", "field 'step' given twice in 'kill:step=1,stage=0,step=5'"),
        ("poisson:rate=0.1,rate=0.2", "field 'rate' given twice"),
    ],
)
def test_parse_rejects_bad_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FailureSchedule.parse(text, topology=Topology(4, 2), steps=30)


def test_faults_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        Kill(step=-1, stage=0, replica=0)
    with pytest.raises(ValueError, match="unknown kill point"):
        Hang(step=1, stage=0, replica=0, at="sometime")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a fault"):
        FailureSchedule(["kill"])  # type: ignore[list-item]


def test_schedule_naming_a_worker_outside_the_job_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"worker \(2,0\) is outside a 2x2 job"):
        Trainer(
            mlp_spec(),
            topology=Topology(2, 2),
            failures=FailureSchedule([Kill(step=1, stage=2, replica=0)]),
        )
    with pytest.raises(ValueError, match=r"worker \(0,5\) is outside"):
        Trainer(
            mlp_spec(),
            topology=Topology(2, 2),
            failures=FailureSchedule([Hang(step=1, stage=0, replica=5)]),
        )


def test_schedule_naming_a_step_outside_the_job_is_refused_before_anything_starts() -> None:
    trainer = Trainer(
        mlp_spec(),
        topology=Topology(2, 2),
        failures=FailureSchedule([Kill(step=10, stage=0, replica=0)]),
    )
    with pytest.raises(ValueError, match="step 10 is outside a job of 10 steps"):
        trainer.fit(10)
