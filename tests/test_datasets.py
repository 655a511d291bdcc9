"""`batches_from_dataset`: an exact cursor over a map-style dataset -- every sample once per
epoch across the replicas, a pure function of the step, the same data whatever fails."""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset, TensorDataset

from parallelism import Topology
from parallelism.datasets import DatasetBatches
from recovery import (
    Kill,
    KillPoint,
    RecoveryPolicy,
    SnapshotPolicy,
    TrainSpec,
    batches_from_dataset,
)
from tests.jobs import drive, make
from tests.test_controller import assert_equal_states
from tests.workloads import adamw, mlp_stage, mse


def indexed(size: int) -> TensorDataset:
    """Sample ``i`` is ``(i, i)``: a batch names the samples it holds."""
    ids = torch.arange(size)
    return TensorDataset(ids, ids)


@settings(max_examples=80, deadline=None)
@given(
    size=st.integers(1, 60),
    batch=st.integers(1, 6),
    replicas=st.integers(1, 4),
    drop_last=st.booleans(),
    seed=st.integers(0, 3),
)
def test_every_sample_is_read_once_per_epoch_across_replicas(
    size: int, batch: int, replicas: int, drop_last: bool, seed: int
) -> None:
    global_batch = batch * replicas
    if size < global_batch:
        with pytest.raises(ValueError, match="fewer than one global batch"):
            batches_from_dataset(indexed(size), batch).indices(0, 0, replicas)
        return
    data = batches_from_dataset(indexed(size), batch, seed=seed, drop_last=drop_last)
    steps = data.steps_per_epoch(replicas)
    for epoch in range(2):
        read: list[int] = []
        for step in range(epoch * steps, (epoch + 1) * steps):
            for r in range(replicas):
                inputs, targets = data(step, r, replicas)
                assert inputs.shape == (batch,) and torch.equal(inputs, targets)
                assert inputs.tolist() == data.indices(step, r, replicas)
                read += inputs.tolist()
        counts = collections.Counter(read)
        assert len(read) == steps * global_batch
        if drop_last:  # each at most once; only the last size % G of the order skipped
            assert max(counts.values()) == 1
            assert len(counts) == size - size % global_batch
            assert set(counts) == set(data.epoch_order(epoch)[: len(counts)].tolist())
        else:  # each at least once; the padding reads the order's first samples again
            assert set(counts) == set(range(size))
            again = [i for i, n in counts.items() if n > 1]
            assert sum(counts.values()) - size == (-size) % global_batch
            assert set(again) <= set(data.epoch_order(epoch)[: (-size) % global_batch].tolist())


def test_the_cursor_is_a_pure_function_of_its_arguments() -> None:
    a = batches_from_dataset(indexed(50), 4, seed=3)
    b = batches_from_dataset(indexed(50), 4, seed=3)
    for step in (0, 5, 6, 17, 40):  # out of order, across epochs
        for r in range(3):
            assert a.indices(step, r, 3) == b.indices(step, r, 3) == a.indices(step, r, 3)
    assert a.indices(0, 0, 3) != batches_from_dataset(indexed(50), 4, seed=4).indices(0, 0, 3)
    # Epochs are drawn afresh: a new order each pass.
    assert a.epoch_order(0).tolist() != a.epoch_order(1).tolist()
    assert batches_from_dataset(indexed(8), 2, shuffle=False).indices(1, 1, 2) == [6, 7]


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(3)


@pytest.mark.parametrize(
    ("dataset", "kwargs", "message"),
    [
        (Stream(), {}, "is an IterableDataset: it has no position"),
        (object(), {}, "must be map-style"),
        ([], {}, "the dataset is empty"),
        (indexed(4), {"batch_size": 0}, "batch_size must be a positive integer"),
        (indexed(4), {"collate_fn": 3}, "collate_fn must be callable"),
    ],
    ids=["iterable", "no-len", "empty", "batch-size", "collate"],
)
def test_bad_datasets_are_refused(dataset: Any, kwargs: dict[str, Any], message: str) -> None:
    args = {"batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        batches_from_dataset(dataset, **args)


def test_a_collate_fn_builds_the_batch() -> None:
    samples = [{"x": torch.full((3,), float(i)), "y": torch.tensor(float(i))} for i in range(8)]

    def collate(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([s["x"] for s in items]), torch.stack([s["y"] for s in items])

    x, y = batches_from_dataset(samples, 4, collate_fn=collate, shuffle=False)(0, 1, 2)
    assert x.shape == (4, 3) and y.tolist() == [4.0, 5.0, 6.0, 7.0]


class Recorded:
    """A batches callback that records which samples each (step, replica) read."""

    def __init__(self, batches: DatasetBatches) -> None:
        self.batches = batches
        self.reads: dict[tuple[int, int], list[list[int]]] = collections.defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, step: int, replica: int, num_replicas: int) -> Any:
        inputs, targets = self.batches(step, replica, num_replicas)
        with self.lock:
            self.reads[(step, replica)].append(targets[:, 0].long().tolist())
        return inputs, targets


class Regression(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i``: a seeded input and its target, whose first entry is ``i`` itself."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, generator=torch.Generator().manual_seed(index))
        target = torch.sin(x)
        target[0] = index
        return x, target


def _run(*faults: object, policy: RecoveryPolicy | None = None) -> tuple[Any, Recorded]:
    data = Recorded(batches_from_dataset(Regression(), 4, seed=1))
    spec = TrainSpec(
        build_stage=mlp_stage, loss_fn=mse, make_optimizer=adamw, batches=data, microbatches=2
    )
    controller, _ = make(spec, Topology(2, 2), *faults, policy=policy, steps=8)
    drive(controller)
    return controller, data


@pytest.mark.parametrize(
    "faults",
    [
        [Kill(step=3, stage=1, replica=0)],
        [
            Kill(step=5, stage=0, replica=0),
            Kill(step=5, stage=0, replica=1, at=KillPoint.MID_PIPELINE),
        ],
    ],
    ids=["kill", "rollback"],
)
def test_a_run_with_failures_reads_exactly_the_samples_of_one_without(faults: list[Kill]) -> None:
    clean, clean_data = _run()
    policy = RecoveryPolicy(exact_only=True, snapshots=SnapshotPolicy(peer_every=2))
    controller, data = _run(*faults, policy=policy)
    assert controller.events, "the failure was not injected"
    assert {r.step for r in controller.records} == {r.step for r in clean.records} == set(range(8))
    # Every (step, replica) read one set of samples, however often it was asked (a
    # rebuilt worker or a rolled-back step asks again), and the same as without failures.
    for key, reads in data.reads.items():
        assert all(r == reads[0] for r in reads), key
    assert {k: v[0] for k, v in data.reads.items()} == {
        k: v[0] for k, v in clean_data.reads.items()
    }
    assert any(len(v) > 1 for (step, _), v in data.reads.items() if step > 0), "no step redone"
    assert_equal_states(controller.final_states, clean.final_states)  # type: ignore[attr-defined]


def test_token_windows_cut_a_corpus_into_next_token_pairs(tmp_path: Any) -> None:
    from parallelism.datasets import TokenWindows
    from parallelism.workloads.data import TokenCorpus

    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(200)) * 5)
    corpus = TokenCorpus.from_path(path, val_fraction=0.1)
    windows = TokenWindows(corpus, 16)
    assert len(windows) == (len(corpus.train) - 1) // 16
    x, y = windows[2]
    assert x.dtype == torch.int64 and torch.equal(x[1:], y[:-1])
    assert x.tolist() == corpus.train[32:48].tolist()
    assert len(TokenWindows(corpus, 16, split="val")) == (len(corpus.val) - 1) // 16
    with pytest.raises(IndexError):
        windows[len(windows)]
    with pytest.raises(ValueError, match="fewer than one window"):
        TokenWindows(corpus, 10_000)
    batch, _ = batches_from_dataset(windows, 4)(0, 1, 2)
    assert batch.shape == (4, 16)
