"""Which worker owns which embedding rows (`ShardLayout`), and the rows it holds
(`EmbeddingShard`); `assemble_tables` puts the full tables back together.

[Note: row sharding]
Rows are split per table into contiguous, balanced ranges: shard ``s`` of a table of
``n`` rows owns rows ``floor(s n / W) .. floor((s+1) n / W) - 1``, so the owner of row
``r`` is ``((r + 1) W - 1) // n``. A shard stores its rows of all tables in one flat
``[rows, dim]`` parameter, table after table (``ShardLayout.offsets``), so a lost shard is
one tensor to mirror, snapshot and restore, and a local row index names one row. Hot
rows land on every shard because ids are hashed (or, in `parallelism.workloads.clicks`, permuted)
over the table, not because of the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from parallelism.checks import check_positive_int
from parallelism.workloads.dlrm.model import init_table_rows

__all__ = ["EmbeddingShard", "ShardLayout", "assemble_tables"]


@dataclass(frozen=True)
class ShardLayout:
    """Which worker owns which embedding rows. See [Note: row sharding].

    Raises:
        ValueError: if ``num_shards`` is not a positive integer, a table size is not a
            positive integer, or a table has fewer rows than there are shards (some shard
            would own none of its rows).
    """

    table_rows: tuple[int, ...]
    num_shards: int
    _bounds: Tensor = field(init=False, repr=False, compare=False)
    _offsets: Tensor = field(init=False, repr=False, compare=False)
    _stride: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "table_rows", tuple(self.table_rows))
        check_positive_int("num_shards", self.num_shards)
        if not self.table_rows:
            raise ValueError("a shard layout needs at least one table")
        for t, rows in enumerate(self.table_rows):
            check_positive_int(f"table_rows[{t}]", rows)
            if rows < self.num_shards:
                raise ValueError(
                    f"table {t} has {rows} rows, fewer than the {self.num_shards} shards: "
                    f"every shard must own at least one row of every table; use at most "
                    f"{rows} workers or a larger table"
                )
        w = self.num_shards
        rows_t = torch.tensor(self.table_rows, dtype=torch.int64)
        bounds = torch.arange(w + 1, dtype=torch.int64)[None, :] * rows_t[:, None] // w  # [T, W+1]
        sizes = (bounds[:, 1:] - bounds[:, :-1]).T  # [W, T]
        offsets = torch.cumsum(sizes, dim=1) - sizes  # [W, T]: table t's first local row
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_stride", int(sizes.sum(dim=1).max()))

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def shard_rows(self, shard: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of the rows ``shard`` owns in each table.

        Raises:
            ValueError: if ``shard`` is outside ``0..num_shards-1``.
        """
        self._check_shard(shard)
        return tuple(
            (int(self._bounds[t, shard]), int(self._bounds[t, shard + 1]))
            for t in range(self.num_tables)
        )

    def shard_size(self, shard: int) -> int:
        """Rows ``shard`` owns over all tables (the length of its flat weight)."""
        return sum(stop - start for start, stop in self.shard_rows(shard))

    def offsets(self, shard: int) -> tuple[int, ...]:
        """Where each table's rows start in ``shard``'s flat weight."""
        self._check_shard(shard)
        return tuple(int(o) for o in self._offsets[shard])

    def owner(self, table: int, rows: Tensor) -> Tensor:
        """The shard owning each of ``rows`` (ids of ``table``), elementwise.

        Raises:
            ValueError: if ``table`` is unknown or a row is outside the table.
        """
        return self._locate_table(table, rows)[0]

    def local_index(self, table: int, rows: Tensor) -> Tensor:
        """Each row's index in its owner's flat weight.

        Raises:
            ValueError: if ``table`` is unknown or a row is outside the table.
        """
        return self._locate_table(table, rows)[1]

    def locate(self, sparse: Tensor) -> tuple[Tensor, Tensor]:
        """``(owner, local index)`` of every id of a ``[B, T]`` batch, one column per table.

        Raises:
            ValueError: if ``sparse`` is not ``[B, T]`` int64, or an id is outside its
                table (naming the table and the id).
        """
        if sparse.dim() != 2 or sparse.shape[1] != self.num_tables or sparse.dtype != torch.int64:
            raise ValueError(
                f"sparse ids must be [batch, {self.num_tables}] int64, got "
                f"{tuple(sparse.shape)} {sparse.dtype}"
            )
        rows = torch.tensor(self.table_rows, dtype=torch.int64)
        bad = (sparse < 0) | (sparse >= rows)
        if bool(bad.any()):
            sample, table = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"id {int(sparse[sample, table])} of table {table} (sample {sample}) is "
                f"outside its {self.table_rows[table]} rows"
            )
        tables = torch.arange(self.num_tables)
        owners = ((sparse + 1) * self.num_shards - 1) // rows
        local = self._offsets[owners, tables] + sparse - self._bounds[tables, owners]
        return owners, local

    def _locate_table(self, table: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        if (
            isinstance(table, bool)
            or not isinstance(table, int)
            or not 0 <= table < self.num_tables
        ):
            raise ValueError(f"table must be in 0..{self.num_tables - 1}, got {table!r}")
        column = torch.zeros(rows.numel(), self.num_tables, dtype=torch.int64)
        column[:, table] = rows.reshape(-1)
        try:
            owners, local = self.locate(column)
        except ValueError as err:
            raise ValueError(f"table {table}: {err}") from None
        return owners[:, table].view_as(rows), local[:, table].view_as(rows)

    def global_rows(self, shard: int) -> tuple[Tensor, Tensor]:
        """``(table, row)`` of each local row of ``shard``, as two int64 tensors."""
        tables, rows = [], []
        for t, (start, stop) in enumerate(self.shard_rows(shard)):
            tables.append(torch.full((stop - start,), t, dtype=torch.int64))
            rows.append(torch.arange(start, stop, dtype=torch.int64))
        return torch.cat(tables), torch.cat(rows)

    def _check_shard(self, shard: int) -> None:
        if (
            isinstance(shard, bool)
            or not isinstance(shard, int)
            or not 0 <= shard < self.num_shards
        ):
            raise ValueError(f"shard must be in 0..{self.num_shards - 1}, got {shard!r}")


class EmbeddingShard(nn.Module):
    """The embedding rows one worker owns, all tables in one flat ``weight``.

    ``weight`` is ``[layout.shard_size(shard), dim]``; ``accumulator`` (a buffer, one
    float per row) is the row-wise Adagrad state. Both are the shard's whole state.
    """

    def __init__(self, layout: ShardLayout, shard: int, dim: int, *, seed: int) -> None:
        super().__init__()
        self.layout = layout
        self.shard = shard
        parts = [
            init_table_rows(seed, t, layout.table_rows[t], start, stop, dim)
            for t, (start, stop) in enumerate(layout.shard_rows(shard))
        ]
        self.weight = nn.Parameter(torch.cat(parts), requires_grad=False)
        self.accumulator: Tensor
        self.register_buffer("accumulator", torch.zeros(self.weight.shape[0]))

    @property
    def num_rows(self) -> int:
        return int(self.weight.shape[0])

    def load(self, weight: Tensor, accumulator: Tensor) -> None:
        """Replace the shard's rows and optimizer state (copies).

        Raises:
            ValueError: if a shape or dtype differs from this shard's, before anything is
                written.
        """
        if weight.shape != self.weight.shape or weight.dtype != self.weight.dtype:
            raise ValueError(
                f"shard {self.shard} weight is {tuple(self.weight.shape)} {self.weight.dtype}; "
                f"got {tuple(weight.shape)} {weight.dtype}"
            )
        if accumulator.shape != self.accumulator.shape or accumulator.dtype != torch.float32:
            raise ValueError(
                f"shard {self.shard} accumulator is {tuple(self.accumulator.shape)} float32; "
                f"got {tuple(accumulator.shape)} {accumulator.dtype}"
            )
        with torch.no_grad():
            self.weight.copy_(weight)
            self.accumulator.copy_(accumulator)


def assemble_tables(layout: ShardLayout, shards: Sequence[Tensor]) -> list[Tensor]:
    """The full tables from every shard's ``weight`` (in shard order), as copies.

    Raises:
        ValueError: if the number or shapes of the shards do not match the layout.
    """
    if len(shards) != layout.num_shards:
        raise ValueError(f"{len(shards)} shards given, the layout has {layout.num_shards}")
    for shard, weight in enumerate(shards):
        if weight.dim() != 2 or weight.shape[0] != layout.shard_size(shard):
            raise ValueError(
                f"shard {shard} is {tuple(weight.shape)}, expected {layout.shard_size(shard)} rows"
            )
    out = []
    for t in range(layout.num_tables):
        parts = []
        for shard, weight in enumerate(shards):
            start, stop = layout.shard_rows(shard)[t]
            offset = layout.offsets(shard)[t]
            parts.append(weight[offset : offset + stop - start])
        out.append(torch.cat(parts))
    return out
