"""A re-run in the folder of an earlier job resumes only if it is the same job: another
model, optimizer or data is refused by name, before anything is loaded; a durable folder
some worker cannot see is refused at the start."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from parallelism import Topology
from recovery import RecoveryPolicy, SnapshotPolicy
from recovery.reference import differences
from recovery.snapshots.identity import describe, job_identity
from recovery.worker import StageWorker
from tests.jobs import drive, make
from tests.workloads import adamw, mlp_spec, regression_batches, relu_stage

TOP = Topology(2, 1)
POLICY = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None, durable_every=2))


def _run(spec, folder: Path, steps: int = 4):  # type: ignore[no-untyped-def]
    controller, _ = make(spec, TOP, policy=POLICY, snapshot_dir=str(folder), steps=steps)
    try:
        controller.run(steps)  # as Trainer.fit: the durable writes in flight land at the end
        controller.final_states = controller.states()  # type: ignore[attr-defined]
    finally:
        controller.shutdown()
    return controller


@pytest.mark.parametrize(
    ("changed", "part"),
    [
        ({"make_optimizer": functools.partial(adamw, lr=0.5)}, "optimizer"),
        ({"batches": functools.partial(regression_batches, size=16)}, "data"),
        ({"build_stage": relu_stage}, "model"),
        ({"microbatches": 2}, "microbatches"),
    ],
    ids=["lr", "data", "model", "microbatches"],
)
def test_another_job_in_the_same_folder_is_refused_naming_what_differs(
    tmp_path: Path, changed: dict[str, object], part: str
) -> None:
    _run(mlp_spec(), tmp_path)
    with pytest.raises(ValueError, match=rf"written by a different job \({part}: "):
        _run(mlp_spec(**changed), tmp_path, steps=6)


@pytest.mark.parametrize(
    ("other", "workers"),
    [(Topology(2, 2), "4 workers"), (Topology(1, 2), "2 workers")],
    ids=["more workers", "same world size"],
)
def test_another_topology_is_named_not_called_corruption(
    tmp_path: Path, other: Topology, workers: str
) -> None:
    """Snapshots of a 2 x 1 job, resumed as another layout: the error names both layouts
    and says what to do -- not that the snapshots failed their checksums (so move them)."""
    _run(mlp_spec(), tmp_path)
    with pytest.raises(ValueError) as info:
        make(mlp_spec(), other, policy=POLICY, snapshot_dir=str(tmp_path))
    text = str(info.value)
    assert "2 stages x 1 replica (2 workers)" in text, text
    assert f"{other.stages} stage{'s' if other.stages > 1 else ''} x 2 replicas ({workers})" in text
    assert "checksum" not in text and "move the folder" not in text
    assert len(list(tmp_path.glob("step_*/COMPLETE.json"))) == 2  # nothing was deleted


def test_the_same_job_resumes(tmp_path: Path) -> None:
    """It resumes from the newest snapshot and ends where the job run in one go ends: the
    same losses of the steps it ran, the same final state of every worker, bit for bit."""
    first = _run(mlp_spec(), tmp_path)
    again = _run(mlp_spec(), tmp_path, steps=6)
    assert first.step == 4 and again.resumed_from == 4 and again.step == 6
    whole, _ = make(mlp_spec(), TOP, steps=6)
    drive(whole)
    assert [r.loss for r in again.records if r.step >= 4] == [
        r.loss for r in whole.records if r.step >= 4
    ]
    found = differences(again.final_states, whole.final_states)  # type: ignore[attr-defined]
    assert not found, found[:5]


def test_the_identity_is_the_same_in_every_process_and_sees_inside_callbacks() -> None:
    spec = mlp_spec()
    assert job_identity(spec) == job_identity(mlp_spec())
    assert (
        "lr=0.5"
        in job_identity(mlp_spec(make_optimizer=functools.partial(adamw, lr=0.5)))["optimizer"]
    )
    a, b = torch.zeros(3), torch.zeros(3)
    b[1] = 1.0
    assert describe(a) != describe(b) and describe(a) == describe(torch.zeros(3))
    assert "0x" not in "".join(job_identity(spec).values())  # no object address


def test_a_durable_folder_a_worker_cannot_see_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = StageWorker.sees_file

    def sees_file(self: StageWorker, path: str, token: str) -> bool:  # blind on rank 1
        return False if self.rank == 1 else real(self, path, token)

    monkeypatch.setattr(StageWorker, "sees_file", sees_file)
    with pytest.raises(ValueError, match=r"worker \(1,0\) on node node-\d cannot see"):
        make(mlp_spec(), TOP, policy=POLICY, snapshot_dir=str(tmp_path))
    assert not list(tmp_path.glob(".shared-*"))  # the probe is cleaned up


# -- what the identity sees inside code (issue 33, item 4) ----------------------------------

LR = 1e-3
"""A global a callback reads: another value is another job."""
ROOT = Path(__file__).resolve().parents[1]


def _reads_lr(params):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=LR)


def _with_lr(lr: float):  # type: ignore[no-untyped-def]
    return lambda params: torch.optim.AdamW(params, lr=lr)


def test_a_global_a_function_reads_is_part_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    make_optimizer = lambda p: torch.optim.AdamW(p, lr=LR)  # noqa: E731
    before = describe(make_optimizer), describe(_reads_lr)
    monkeypatch.setattr(sys.modules[__name__], "LR", 1e-2)
    after = describe(make_optimizer), describe(_reads_lr)
    assert before[0] != after[0] and before[1] != after[1]
    assert "LR=0.01" in after[0]  # the value shows where the message can show it
    spec = mlp_spec(make_optimizer=make_optimizer)
    assert job_identity(spec)["optimizer"] != job_identity(mlp_spec())["optimizer"]


def test_two_lambdas_with_another_body_differ() -> None:
    adam = lambda p: torch.optim.AdamW(p, lr=0.1)  # noqa: E731
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    assert describe(adam) != describe(sgd)
    assert describe(adam) == describe(lambda p: torch.optim.AdamW(p, lr=0.1))  # same code


def test_closures_defaults_and_partials_are_seen_by_value() -> None:
    assert describe(_with_lr(0.1)) != describe(_with_lr(0.2))
    assert describe(_with_lr(0.1)) == describe(_with_lr(0.1))
    assert describe(lambda p, lr=0.1: p) != describe(lambda p, lr=0.2: p)
    assert describe(lambda p, *, lr=0.1: p) != describe(lambda p, *, lr=0.2: p)
    assert describe(functools.partial(_with_lr(0.1))) != describe(functools.partial(_with_lr(0.2)))


_log = logging.getLogger("tests.identity")


def _logs_its_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = ((out - target) ** 2).mean()
    _log.debug("loss %s", loss)
    return loss


def test_a_logger_a_function_uses_is_not_part_of_the_job() -> None:
    """Run state a global holds -- a logger's level and handlers, a lock -- is not the job:
    a re-run with ``-v`` resumes."""
    before = describe(_logs_its_loss)
    _log.setLevel(logging.DEBUG)
    _log.addHandler(logging.NullHandler())
    try:
        assert describe(_logs_its_loss) == before
    finally:
        _log.setLevel(logging.NOTSET)
        _log.handlers.clear()
    assert describe(threading.Lock()) == describe(threading.Lock())


def test_recursion_and_cycles_end() -> None:
    def countdown(n: int) -> int:
        return countdown(n - 1) if n else 0

    loop: list[object] = [1]
    loop.append(loop)
    assert describe(countdown) == describe(countdown)
    assert describe(loop) == describe(loop)


def test_whole_tensors_and_long_lists_are_hashed_but_shown_short() -> None:
    a = torch.zeros(1 << 19)  # 2 MiB of float32
    b = a.clone()
    b[-1] = 1.0
    assert describe(a) != describe(b)
    c = a.numpy().copy()
    c[-1] = 1.0
    assert describe(a.numpy()) != describe(c)
    long, other = list(range(1000)), list(range(1000))
    other[900] = -1
    assert describe(long) != describe(other)
    assert describe({i: i for i in long}) != describe({i: i for i in other})
    assert len(describe(long)) < 200


def test_the_identity_is_the_same_in_another_process() -> None:
    """Deterministic: no ids, no addresses, no hash-seeded order (a set's, a frozenset
    constant's), whatever PYTHONHASHSEED is."""
    program = (
        "import json; from tests.test_resume_identity import closure_spec;"
        "from recovery.snapshots.identity import job_identity;"
        "print(json.dumps(job_identity(closure_spec())))"
    )
    seen = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        seen.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert seen[0] == seen[1] == job_identity(closure_spec())


def closure_spec():  # type: ignore[no-untyped-def]
    """A spec whose callbacks close over values, read globals and hold a set and tensors."""
    names = {"alpha", "beta", "gamma"}
    weights = torch.arange(10.0)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # (no assert here: pytest rewrites a test module's asserts, so its code would
        # differ from the subprocess's)
        if not names or "beta" not in {"alpha", "beta"}:
            raise ValueError(names)
        return ((out - target) ** 2).mean() * weights[0] * LR

    return mlp_spec(make_optimizer=_with_lr(0.3), loss_fn=loss)
