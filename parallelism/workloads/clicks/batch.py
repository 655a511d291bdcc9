"""A batch of click logs (`ClickBatch`) and what every source of them shares (`ClickSource`).

A source serves batches the way `parallelism.workloads.data.LMBatches` does: a pure
function of ``(step, replica, microbatch)``, so a step re-run after a failure sees exactly
the data it saw the first time and the data cursor is just the step number. Its two
sources: generated logs (`parallelism.workloads.clicks.synthetic.ClickLogs`) and a fixed
set of samples such as a Criteo file (`parallelism.workloads.clicks.dataset.ClickDataset`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from parallelism.checks import check_index, check_positive_int, check_replica_share

__all__ = ["ClickBatch", "ClickSource", "GlobalClicks"]

_SPLITS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class ClickBatch:
    """Samples of click logs: dense features, sparse ids and labels, aligned on dim 0."""

    dense: Tensor
    """``[samples, dense_features]`` float32."""
    sparse: Tensor
    """``[samples, tables]`` int64: the row of each table each sample looks up."""
    labels: Tensor
    """``[samples]`` float32, 0 or 1 (click)."""

    def __post_init__(self) -> None:
        n = self.labels.shape[0] if self.labels.dim() == 1 else -1
        if (
            self.dense.dim() != 2
            or self.sparse.dim() != 2
            or self.labels.dim() != 1
            or self.dense.shape[0] != n
            or self.sparse.shape[0] != n
        ):
            raise ValueError(
                f"a click batch needs dense [n, d], sparse [n, tables] and labels [n]; got "
                f"{tuple(self.dense.shape)}, {tuple(self.sparse.shape)}, {tuple(self.labels.shape)}"
            )
        if self.sparse.dtype != torch.int64:
            raise ValueError(f"sparse ids must be int64, got {self.sparse.dtype}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def chunk(self, parts: int) -> list[ClickBatch]:
        """Split into ``parts`` consecutive batches (``torch.chunk`` sizes)."""
        return [
            ClickBatch(dense=d, sparse=s, labels=y)
            for d, s, y in zip(
                self.dense.chunk(parts),
                self.sparse.chunk(parts),
                self.labels.chunk(parts),
                strict=True,
            )
        ]

    @staticmethod
    def cat(batches: Sequence[ClickBatch]) -> ClickBatch:
        """Concatenate batches along dim 0.

        Raises:
            ValueError: if ``batches`` is empty.
        """
        if not batches:
            raise ValueError("cannot concatenate zero click batches")
        return ClickBatch(
            dense=torch.cat([b.dense for b in batches]),
            sparse=torch.cat([b.sparse for b in batches]),
            labels=torch.cat([b.labels for b in batches]),
        )


class ClickSource(abc.ABC):
    """What both sources share: deterministic microbatches, replica batches, held-out data."""

    batch_size: int
    microbatches: int
    seed: int

    @abc.abstractmethod
    def _draw(self, split: str, key: list[int], size: int, *, fixed: bool = False) -> ClickBatch:
        """``size`` samples of ``split`` from a generator keyed by ``key``; ``fixed``: the
        held-out set of `heldout`."""

    def microbatch(
        self, step: int, replica: int, microbatch: int, *, split: str = "train"
    ) -> ClickBatch:
        """One microbatch of ``batch_size`` samples, a pure function of its arguments.

        Raises:
            ValueError: for an unknown split, a negative step or replica, or a microbatch
                outside ``0..microbatches-1``.
        """
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        check_index("step", step)
        check_index("replica", replica)
        check_index("microbatch", microbatch, self.microbatches)
        key = [self.seed, _SPLITS[split], int(step), int(replica), int(microbatch)]
        return self._draw(split, key, self.batch_size)

    def __call__(self, step: int, replica: int, num_replicas: int) -> ClickBatch:
        """The replica's batch for ``step``: its microbatches concatenated.

        Raises:
            ValueError: if ``replica`` is outside ``0..num_replicas-1`` or ``step`` < 0.
        """
        check_positive_int("num_replicas", num_replicas)
        check_index("replica", replica, num_replicas)
        return ClickBatch.cat(
            [self.microbatch(step, replica, mb) for mb in range(self.microbatches)]
        )

    def validation(self, index: int, replica: int, num_replicas: int) -> ClickBatch:
        """Held-out batch ``index`` of a replica.

        Raises:
            ValueError: if ``replica`` is outside ``0..num_replicas-1`` or ``index`` < 0.
        """
        check_positive_int("num_replicas", num_replicas)
        check_index("replica", replica, num_replicas)
        return ClickBatch.cat(
            [self.microbatch(index, replica, mb, split="val") for mb in range(self.microbatches)]
        )

    def heldout(self, samples: int) -> ClickBatch:
        """A fixed held-out set of ``samples`` samples (the same on every call).

        Raises:
            ValueError: if ``samples`` is not a positive integer.
        """
        check_positive_int("samples", samples)
        return self._draw("val", [self.seed, len(_SPLITS), samples], samples, fixed=True)


@dataclass(frozen=True)
class GlobalClicks:
    """``(step, replica, num_replicas) -> ClickBatch``: replica ``replica``'s run of the
    step's one global batch of ``global_batch_size`` samples, drawn from ``source`` by the
    step alone -- so every step reads the same samples whatever the replica count, and the
    job can resume on another one (``Trainer(resume="reshard")``).

    Raises:
        ValueError: for a global batch that is not a positive integer, or (when called) a
            replica count that does not divide it, naming both.
    """

    source: ClickSource
    global_batch_size: int

    def __post_init__(self) -> None:
        check_positive_int("global_batch_size", self.global_batch_size)

    def __call__(self, step: int, replica: int, num_replicas: int) -> ClickBatch:
        check_index("step", step)
        per = check_replica_share(self.global_batch_size, num_replicas)
        check_index("replica", replica, num_replicas)
        # Keyed [seed, split, step]: no microbatch's key (five parts) nor the held-out set's.
        whole = self.source._draw(
            "train", [self.source.seed, _SPLITS["train"], int(step)], self.global_batch_size
        )
        part = slice(replica * per, (replica + 1) * per)
        return ClickBatch(
            dense=whole.dense[part], sparse=whole.sparse[part], labels=whole.labels[part]
        )
