"""A replica's batch of a map-style ``Dataset`` as a pure function of the step: an exact cursor.

`batches_from_dataset` turns any ``torch.utils.data.Dataset`` with ``__len__`` and
``__getitem__`` into the ``batches(step, replica, num_replicas)`` callback a `TrainSpec`
takes. Which samples a step reads depends on nothing but its arguments and the seed, never
on what ran before, so the data a job sees does not change when workers die, are rebuilt,
roll back, or when the driver restarts and resumes from a snapshot.

[Note: the dataset cursor]
A step's global batch ``G`` is ``global_batch_size`` samples when the job states it, else
``batch_size * num_replicas``; each replica reads ``G / num_replicas`` of them. An epoch is
``len(dataset) // G`` steps (one more with ``drop_last=False``
when samples are left over); step ``t`` is in epoch ``e = t // steps_per_epoch``, whose
order is a permutation of the dataset drawn from ``(seed, e)``; its ``k``-th step reads
positions ``[k * G, (k + 1) * G)`` of that order (``G`` the global batch), and replica
``r`` the ``r``-th run of ``G / num_replicas`` of them. So every sample is read exactly once per
epoch across the replicas -- except that ``drop_last=True`` (the default) skips the
``len % G`` samples the permutation puts last, and ``drop_last=False`` fills the epoch's
last global batch with the permutation's first samples (read twice that epoch), as
``DistributedSampler`` pads. A replica's slice is computed from ``num_replicas``, not from
who is alive: a survivor can compute a missing replica's share with the same call.
Iterable-style datasets have no position to return to and are refused.

A stated ``global_batch_size`` makes the global batch the job's, not the topology's: the
samples of step ``t`` are the same for any replica count that divides it (a replica count
that does not is refused, naming both numbers), so a job resumed on another topology
(``Trainer(resume="reshard")``) reads exactly the samples it would have read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from parallelism.checks import check_positive_int, check_replica_share
from parallelism.seeding import derive_seed

if TYPE_CHECKING:
    from parallelism.workloads.data import TokenCorpus

__all__ = ["DatasetBatches", "TokenWindows", "batches_from_dataset"]


@dataclass(frozen=True)
class DatasetBatches:
    """``(step, replica, num_replicas) -> batch`` over a map-style dataset. See
    [Note: the dataset cursor].

    Raises:
        ValueError: for an iterable-style dataset, one without ``__len__`` /
            ``__getitem__``, an empty one, or a batch size that is not a positive integer.
    """

    dataset: Any
    """A map-style dataset: ``len(dataset)`` samples, ``dataset[i]`` for ``0 <= i < len``."""
    batch_size: int | None = None
    """Samples per replica per step (the global batch then grows with the replicas); or
    None with ``global_batch_size``."""
    seed: int = 0
    """Seeds each epoch's permutation."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """Samples -> batch; default ``torch.utils.data.default_collate``, a pair (list) made
    into the ``(inputs, targets)`` tuple a `TrainSpec` expects."""
    drop_last: bool = True
    """Skip the samples left over at an epoch's end (else pad with the epoch's first)."""
    shuffle: bool = True
    """Draw each epoch's order at random; False: the dataset's order every epoch."""
    global_batch_size: int | None = None
    """Samples per step over all replicas, whatever their number (each replica reads
    ``global_batch_size / num_replicas``); None: ``batch_size`` per replica."""

    def __post_init__(self) -> None:
        if isinstance(self.dataset, IterableDataset):
            raise ValueError(
                f"{type(self.dataset).__name__} is an IterableDataset: it has no position a "
                "rebuilt or rolled-back worker can return to, so the data would change with "
                "failures. Give a map-style Dataset (__len__ and __getitem__), e.g. by "
                "materialising the stream into a list or an index over its files"
            )
        for name in ("__len__", "__getitem__"):
            if not hasattr(self.dataset, name):
                raise ValueError(
                    f"the dataset must be map-style (__len__ and __getitem__); "
                    f"{type(self.dataset).__name__} has no {name}"
                )
        if (self.batch_size is None) == (self.global_batch_size is None):
            raise ValueError(
                "give batch_size (samples per replica) or global_batch_size (samples per "
                f"step over all replicas), exactly one; got batch_size={self.batch_size!r}, "
                f"global_batch_size={self.global_batch_size!r}"
            )
        if self.batch_size is not None:
            check_positive_int("batch_size", self.batch_size)
        if self.global_batch_size is not None:
            check_positive_int("global_batch_size", self.global_batch_size)
        if len(self.dataset) < 1:
            raise ValueError("the dataset is empty")
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise ValueError(f"collate_fn must be callable or None, got {self.collate_fn!r}")

    def __len__(self) -> int:
        return len(self.dataset)

    def replica_batch(self, num_replicas: int) -> int:
        """Samples each of ``num_replicas`` replicas reads per step.

        Raises:
            ValueError: if ``num_replicas`` does not divide the stated global batch,
                naming both numbers.
        """
        check_positive_int("num_replicas", num_replicas)
        if self.batch_size is not None:
            return self.batch_size
        assert self.global_batch_size is not None
        return check_replica_share(self.global_batch_size, num_replicas)

    def global_batch(self, num_replicas: int) -> int:
        """Samples per step over ``num_replicas`` replicas.

        Raises:
            ValueError: see `replica_batch`.
        """
        return self.replica_batch(num_replicas) * num_replicas

    def steps_per_epoch(self, num_replicas: int) -> int:
        """Steps in one pass over the dataset with ``num_replicas`` replicas.

        Raises:
            ValueError: if the dataset holds fewer samples than one global batch, or
                ``num_replicas`` does not divide a stated global batch.
        """
        per = self.replica_batch(num_replicas)
        size, global_batch = len(self.dataset), per * num_replicas
        if size < global_batch:
            raise ValueError(
                f"the dataset has {size} samples, fewer than one global batch of "
                f"{global_batch} ({per} per replica x {num_replicas} replicas)"
            )
        full, rest = divmod(size, global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The dataset's positions in the order epoch ``epoch`` reads them."""
        size = len(self.dataset)
        if not self.shuffle:
            return torch.arange(size)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
        return torch.randperm(size, generator=generator)

    def indices(self, step: int, replica: int, num_replicas: int) -> list[int]:
        """The dataset positions replica ``replica`` reads at ``step`` (a pure function).

        Raises:
            ValueError: for a negative step or a replica outside ``[0, num_replicas)``.
        """
        check_positive_int("num_replicas", num_replicas)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if not 0 <= replica < num_replicas:
            raise ValueError(f"replica must be in [0, {num_replicas}), got {replica!r}")
        epoch, k = divmod(step, self.steps_per_epoch(num_replicas))
        order = self.epoch_order(epoch)
        per = self.replica_batch(num_replicas)
        start = k * per * num_replicas + replica * per
        positions = torch.arange(start, start + per) % len(order)
        return order[positions].tolist()

    def __call__(self, step: int, replica: int, num_replicas: int) -> Any:
        samples = [self.dataset[i] for i in self.indices(step, replica, num_replicas)]
        batch = (self.collate_fn or default_collate)(samples)
        if isinstance(batch, list) and len(batch) == 2:
            batch = tuple(batch)
        return batch


def batches_from_dataset(
    dataset: Dataset[Any] | Sequence[Any],
    batch_size: int | None = None,
    *,
    global_batch_size: int | None = None,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    drop_last: bool = True,
    shuffle: bool = True,
) -> DatasetBatches:
    """The ``batches`` callback of a `TrainSpec` over a map-style dataset.

    ``batch_size`` samples per replica per step, or ``global_batch_size`` samples per step
    over all replicas (the job's global batch, kept on any topology that divides it: what
    a resume on another topology needs), each epoch a seeded permutation split into
    disjoint per-replica slices (see [Note: the dataset cursor]); use it for ``val_batches``
    too, over the held-out dataset. The dataset is pickled into every worker.

    Raises:
        ValueError: see `DatasetBatches`.
    """
    return DatasetBatches(
        dataset=dataset,
        batch_size=batch_size,
        seed=seed,
        collate_fn=collate_fn,
        drop_last=drop_last,
        shuffle=shuffle,
        global_batch_size=global_batch_size,
    )


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A token corpus as a map-style dataset: item ``i`` is the ``i``-th non-overlapping
    window of ``seq_len + 1`` tokens, as (inputs, next tokens), ``int64``.

    The corpus (`parallelism.workloads.data.TokenCorpus`: a text file, nanoGPT's ``.bin``,
    ``.npy``, or the Python standard library's source) pickles as a recipe and loads its
    tokens once per worker process.

    Raises:
        ValueError: for a bad ``seq_len`` or ``split``, or a corpus shorter than a window.
    """

    def __init__(self, corpus: TokenCorpus, seq_len: int, split: str = "train") -> None:
        check_positive_int("seq_len", seq_len)
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.corpus, self.seq_len, self.split = corpus, seq_len, split
        if len(self) < 1:
            raise ValueError(
                f"the corpus's {split} part holds {len(self._tokens())} tokens, fewer than "
                f"one window of {seq_len + 1}"
            )

    def _tokens(self) -> Any:
        return self.corpus.train if self.split == "train" else self.corpus.val

    def __len__(self) -> int:
        return (len(self._tokens()) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.seq_len
        window = torch.from_numpy(self._tokens()[start : start + self.seq_len + 1].astype("int64"))
        return window[:-1], window[1:]
