"""A job resumed on another topology (``resume="reshard"``) goes on as if it had never
stopped: every later step reads the same samples in its global batch and gives the loss
of the job that kept its first topology. Each refusal says why. See [Note: resharding a
snapshot] in recovery/snapshots/reshard.py.

The jobs are threads (`ThreadWorkerGroup`), as in tests/jobs.py; the oracle is an
uninterrupted run on the first topology, 2 stages x 2 replicas.
"""

from __future__ import annotations

import functools
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from parallelism import Topology
from parallelism.datasets import DatasetBatches
from parallelism.spec import TrainSpec
from parallelism.workloads.dlrm.spec import dlrm_spec
from parallelism.workloads.llama_spec import llama_spec
from recovery import RecoveryPolicy, SnapshotPolicy, Trainer, batches_from_dataset
from recovery.groups import ThreadWorkerGroup
from recovery.runtime import Controller, ControllerConfig
from recovery.runtime.layouts import layout_for
from recovery.snapshots import DurableStore
from recovery.snapshots.reshard import load_resharded
from recovery.state import Progress, Rebuild, WorkerState
from tests.workloads import TinyLM, TokenSequences, adamw, lm_loss, mlp_spec, mse

FIRST = Topology(stages=2, replicas=2)
STOP, END = 4, 6
"""The first job stops after step ``STOP`` (a durable snapshot there); the resumed one
trains on to ``END``."""
DURABLE = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None, durable_every=2))
PLAIN = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None))

Seen = dict[tuple[int, int], dict[int, list[int]]]
"""Sample ids read, by (replicas, step), then replica."""


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[Seen]:
    """Every training sample id a worker reads (the workers are threads of this process)."""
    log: Seen = {}
    real = DatasetBatches.indices

    def indices(self: DatasetBatches, step: int, replica: int, num_replicas: int) -> list[int]:
        out = real(self, step, replica, num_replicas)
        if getattr(self.dataset, "split", "train") == "train":
            log.setdefault((num_replicas, step), {})[replica] = out
        return out

    monkeypatch.setattr(DatasetBatches, "indices", indices)
    yield log


def global_batches(log: Seen, replicas: int, steps: range) -> list[list[int]]:
    """Each step's global batch: its replicas' sample ids, in replica order."""
    out = []
    for step in steps:
        got = log[(replicas, step)]
        assert sorted(got) == list(range(replicas)), (step, sorted(got))
        out.append([i for r in range(replicas) for i in got[r]])
    return out


def run(
    spec: TrainSpec,
    top: Topology,
    steps: int,
    folder: Path | None = None,
    *,
    reshard: bool = False,
    policy: RecoveryPolicy = DURABLE,
) -> Controller:
    """``spec`` on ``top`` for ``steps`` committed steps, its workers threads; durable
    snapshots in ``folder`` (resumed from, by name with ``reshard``)."""
    policy = policy if folder is not None else PLAIN
    group = ThreadWorkerGroup(
        layout_for(spec, top, policy, 1).worker_cls, nodes=["node-0", "node-1"]
    )
    config = ControllerConfig(
        backend="gloo", snapshot_dir=None if folder is None else str(folder), reshard=reshard
    )
    controller = Controller(spec, top, config, policy=policy, group=group)
    try:
        controller.start()
        controller.run(steps)
    finally:
        controller.shutdown()
    return controller


def losses(controller: Controller, steps: range) -> list[float]:
    by_step = {r.step: r.loss for r in controller.records}
    return [by_step[s] for s in steps]


def assert_close(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(a, b, rel_tol=rel), (step, a, b)


# -- the jobs ---------------------------------------------------------------------------------


def tiny_lm() -> TinyLM:
    return TinyLM(vocab=32, dim=16, blocks=4)


def module_spec(microbatches: int = 2) -> TrainSpec:
    """`TinyLM` cut by torch's pipelining, a global batch of 8 sequences; 2 microbatches of
    2 per replica of 2 (with 4 replicas: 1 microbatch of 2, the traced shape)."""
    return TrainSpec.from_module(
        tiny_lm,
        example_input=torch.zeros(2, 8, dtype=torch.long),
        loss_fn=lm_loss,
        make_optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
        batches=batches_from_dataset(TokenSequences(64), global_batch_size=8),
        microbatches=microbatches,
        name="tiny-lm",
    )


@functools.cache
def llama(microbatches: int = 2) -> TrainSpec:
    return llama_spec(
        preset="tiny",
        seq_len=16,
        microbatches=microbatches,
        global_batch_size=8,
        warmup_steps=2,
        clip_grad_norm=None,  # clipping is per stage: another cut clips otherwise
        max_bytes=2_000_000,
    )


def reshard_and_compare(
    spec: TrainSpec,
    tmp_path: Path,
    seen: Seen,
    targets: list[tuple[Topology, TrainSpec]],
    start: Topology = FIRST,
) -> None:
    """``spec`` on ``start`` to `END`, uninterrupted, with durable snapshots; each target
    resumes from a copy of its snapshot of step `STOP` (the later one taken away): the
    losses and the global batches (sample ids, of a `DatasetBatches`) of steps
    STOP..END-1 are the uninterrupted run's."""
    first = tmp_path / "first"
    ids = isinstance(spec.batches, DatasetBatches)
    whole = run(spec, start, END, first)
    want_batches = global_batches(seen, start.replicas, range(STOP, END)) if ids else []
    want = losses(whole, range(STOP, END))
    for top, resumed_spec in targets:
        folder = tmp_path / f"{top.stages}x{top.replicas}"
        shutil.copytree(first, folder)
        for later in folder.glob("step_*"):
            if int(later.name.removeprefix("step_")) > STOP:
                shutil.rmtree(later)
        seen.clear()
        again = run(resumed_spec, top, END, folder, reshard=True)
        assert again.resumed_from == STOP and again.persistence.resharded_from == start
        if ids:
            assert global_batches(seen, top.replicas, range(STOP, END)) == want_batches, top
        assert_close(losses(again, range(STOP, END)), want)


def test_a_module_resumes_on_four_stages(tmp_path: Path, seen: Seen) -> None:
    reshard_and_compare(module_spec(), tmp_path, seen, [(Topology(4, 2), module_spec())])


@pytest.mark.slow
def test_a_module_resumes_on_one_stage_and_on_four_replicas(tmp_path: Path, seen: Seen) -> None:
    reshard_and_compare(
        module_spec(),
        tmp_path,
        seen,
        [(Topology(1, 2), module_spec()), (Topology(2, 4), module_spec(microbatches=1))],
    )


def test_llama_resumes_on_another_cut_and_more_replicas(tmp_path: Path, seen: Seen) -> None:
    reshard_and_compare(
        llama(),
        tmp_path,
        seen,
        [(Topology(4, 2), llama()), (Topology(1, 2), llama()), (Topology(2, 4), llama(1))],
    )


def test_dlrm_rows_move_to_their_new_owners(tmp_path: Path, seen: Seen) -> None:
    """Row-sharded tables over 2 workers, resumed on 4 and on 1 (whole tables): every row
    lands on its new owner with its row-wise optimizer state, and the losses go on."""
    spec = dlrm_spec(preset="tiny", global_batch_size=48)
    targets = [(Topology(1, 4), spec), (Topology(1, 1), spec)]
    reshard_and_compare(spec, tmp_path, seen, targets, start=Topology(1, 2))


def test_a_stated_global_batch_is_the_same_samples_on_any_replica_count() -> None:
    """`batches_from_dataset(global_batch_size=...)` and `GlobalClicks`: each replica reads
    its run of one global batch; a batch size given twice, or not at all, is refused."""
    data = batches_from_dataset(list(range(100)), global_batch_size=12, seed=5)
    for step in (0, 7, 8, 30):  # 8 steps per epoch: the epochs' orders differ
        whole = data.indices(step, 0, 1)
        for replicas in (2, 3, 4, 6, 12):
            assert [i for r in range(replicas) for i in data.indices(step, r, replicas)] == whole
    with pytest.raises(ValueError, match="global batch of 12 samples does not divide among 5"):
        data(0, 0, 5)
    for sizes in ({"batch_size": 4, "global_batch_size": 8}, {}):
        with pytest.raises(ValueError, match="exactly one"):
            batches_from_dataset(list(range(10)), **sizes)
    clicks = dlrm_spec(preset="tiny", global_batch_size=12).batches
    one = clicks(3, 0, 1)
    parts = [clicks(3, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p.sparse for p in parts]), one.sparse)
    assert torch.equal(torch.cat([p.labels for p in parts]), one.labels)


# -- refusals ---------------------------------------------------------------------------------


def regression_pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(64, 16, generator=g)
    return list(zip(xs, torch.sin(xs), strict=True))


def named_mlp_spec(**overrides: Any) -> TrainSpec:
    """`mlp_spec` on a dataset with a global batch of 8 (its stages share their names)."""
    overrides.setdefault("batches", batches_from_dataset(regression_pairs(), global_batch_size=8))
    return mlp_spec(microbatches=2, **overrides)


@pytest.fixture
def snapshots(tmp_path: Path) -> Path:
    """Durable snapshots (steps 2 and 4) of `named_mlp_spec` on `FIRST`."""
    run(named_mlp_spec(), FIRST, STOP, tmp_path)
    return tmp_path


def test_a_global_batch_the_replicas_do_not_divide_is_refused(snapshots: Path) -> None:
    with pytest.raises(ValueError, match="global batch of 8 samples does not divide among 3"):
        run(named_mlp_spec(), Topology(2, 3), END, snapshots, reshard=True)


def test_another_topology_without_reshard_is_refused_naming_both(snapshots: Path) -> None:
    with pytest.raises(ValueError) as refused:
        run(named_mlp_spec(), Topology(4, 2), END, snapshots)
    text = str(refused.value)
    assert "2 stages x 2 replicas (4 workers)" in text and "4 stages x 2 replicas" in text
    assert 'resume="reshard"' in text


def test_more_replicas_without_a_global_batch_are_refused(tmp_path: Path) -> None:
    run(mlp_spec(microbatches=2), FIRST, STOP, tmp_path)
    with pytest.raises(ValueError, match="changes the replica count, but the job's batches do not"):
        run(mlp_spec(microbatches=2), Topology(2, 4), END, tmp_path, reshard=True)


def test_stages_that_do_not_name_their_parameters_globally_are_refused(snapshots: Path) -> None:
    """Each `mlp_stage` calls its layer ``0``: a new cut cannot tell whose is whose."""
    with pytest.raises(ValueError, match=r"0\.(weight|bias) is in old stages 0 and 1"):
        run(named_mlp_spec(), Topology(1, 2), END, snapshots, reshard=True)


def test_never_refuses_a_folder_with_snapshots_before_any_worker_starts(snapshots: Path) -> None:
    policy = RecoveryPolicy(
        snapshots=SnapshotPolicy(peer_every=None, durable_every=2, dir=str(snapshots))
    )
    trainer = Trainer(named_mlp_spec(), topology=FIRST, policy=policy, resume="never")
    with pytest.raises(ValueError, match='starts afresh \\(resume="never"\\)'):
        trainer.fit(2)  # no Ray cluster is started: the folder is refused first
    with pytest.raises(ValueError, match="resume must be one of 'auto', 'reshard', 'never'"):
        Trainer(named_mlp_spec(), topology=FIRST, resume="always")  # type: ignore[arg-type]


# -- by name, below the controller ------------------------------------------------------------


def _stage(
    names: list[str], *, trained: bool = True, progress: Progress | None = None
) -> WorkerState:
    """A stage of ``Linear(3, 3)`` layers named ``names``, one AdamW step taken if ``trained``."""
    module = torch.nn.ModuleDict({n: torch.nn.Linear(3, 3) for n in names})
    optimizer = adamw(module.parameters())
    if trained:
        x = torch.randn(2, 3)
        torch.stack([mse(m(x), torch.zeros(2, 3)) for m in module.values()]).sum().backward()
        optimizer.step()
    return WorkerState(module, optimizer, progress or Progress(step=4))


def _written(tmp_path: Path, stages: list[WorkerState]) -> DurableStore:
    store = DurableStore(tmp_path)
    for rank, state in enumerate(stages):
        store.wait(store.write(rank, state))
    store.commit(4, len(stages))
    return store


def test_optimizer_state_follows_its_parameter_by_name(tmp_path: Path) -> None:
    """Two old stages ``a`` | ``b c``, one new stage ``c b a`` (other positions in its
    optimizer): every moment lands on its own parameter."""
    old = [_stage(["a"]), _stage(["b", "c"])]
    store = _written(tmp_path, old)
    new = _stage(["c", "b", "a"], trained=False, progress=Progress())
    progress = load_resharded(store, 4, Topology(2, 1), new)
    assert progress == Progress(step=4)
    theirs = {**_moments(old[0]), **_moments(old[1])}
    mine = _moments(new)
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key


def _moments(state: WorkerState) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in state.module.named_parameters()}
    out = {}
    for p, entry in state.optimizer.state.items():
        out[names[id(p)]] = entry["exp_avg"]
        out[names[id(p)] + ".param"] = p.detach()
    return out


def test_a_rebuild_mark_goes_with_its_parameters(tmp_path: Path) -> None:
    """A new stage made of one rebuilt old stage carries its mark; one that mixes a rebuilt
    stage with another is refused, naming the stages."""
    mark = Rebuild(step=3, lr_scale=0.5, lr_scale_steps=None, rewarm_steps=0)
    old = [_stage(["a"]), _stage(["b"], progress=Progress(step=4, rebuild=mark))]
    store = _written(tmp_path, old)
    alone = _stage(["b"], trained=False, progress=Progress())
    assert load_resharded(store, 4, Topology(2, 1), alone).rebuild == mark
    mixed = _stage(["a", "b"], trained=False, progress=Progress())
    with pytest.raises(ValueError, match=r"old stages \[0, 1\].*different CheckFree rebuild"):
        load_resharded(store, 4, Topology(2, 1), mixed)


# -- the command line -------------------------------------------------------------------------


def test_the_train_command_resumes_with_a_reshard(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resume reshard --global-batch 16`` reaches the `Trainer` with a global batch."""
    from recovery.cli import train

    class Stop(Exception):
        pass

    got: dict[str, Any] = {}

    def trainer(spec: TrainSpec, **kwargs: Any) -> None:
        got.update(kwargs, spec=spec)
        raise Stop

    monkeypatch.setattr(train, "Trainer", trainer)
    argv = ["--preset", "tiny", "--resume", "reshard", "--global-batch", "16", "--replicas", "4"]
    with pytest.raises(Stop):
        train.main([*argv, "--stages", "2", "--out", "/nonexistent/never-written"])
    assert got["resume"] == "reshard" and got["topology"] == Topology(2, 4)
    assert got["spec"].batches.global_batch_size == 16
    with pytest.raises(SystemExit):
        train.parse_args(["--resume", "always"])
