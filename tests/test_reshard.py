"""A job resumed on another topology (``resume="reshard"``) goes on as if it had never
stopped: every later step reads the same samples in its global batch and gives the loss
of the job that kept its first topology. Each refusal says why. See [Note: resharding a
snapshot] in recovery/snapshots/reshard.py.

The jobs are threads (`ThreadWorkerGroup`), as in tests/jobs.py; the oracle is an
uninterrupted run on the first topology, 2 stages x 2 replicas.
"""

from __future__ import annotations

import dataclasses
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
from parallelism.workloads.llama_spec import llama_spec
from recovery import RecoveryPolicy, SnapshotPolicy, Trainer, batches_from_dataset
from recovery.groups import ThreadWorkerGroup
from recovery.runtime import Controller, ControllerConfig
from recovery.runtime.layouts import layout_for
from tests.workloads import TinyLM, TokenSequences, lm_loss

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
        max_bytes=200_000,
    )


def reshard_and_compare(
    spec: TrainSpec, tmp_path: Path, seen: Seen, targets: list[tuple[Topology, TrainSpec]]
) -> None:
    """Snapshots of ``spec`` on `FIRST` up to `STOP`; each target resumes from a copy of
    them: the losses and the global batches of steps STOP..END-1 are the uninterrupted run's."""
    first = tmp_path / "first"
    run(spec, FIRST, STOP, first)
    seen.clear()
    whole = run(spec, FIRST, END)
    want_batches = global_batches(seen, FIRST.replicas, range(STOP, END))
    want = losses(whole, range(STOP, END))
    for top, resumed_spec in targets:
        folder = tmp_path / f"{top.stages}x{top.replicas}"
        shutil.copytree(first, folder)
        seen.clear()
        again = run(resumed_spec, top, END, folder, reshard=True)
        assert again.resumed_from == STOP and again.persistence.resharded_from == FIRST
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
