"""The Criteo TSV format: `read_criteo` parses a file (label, 13 integer features, 26
categorical ones per line) into a `ClickBatch`, a chunk of lines at a time
(`criteo_chunks`, which the on-disk cache of `parallelism.workloads.clicks.cache` parses
with too), refusing a malformed line with its ``file:line``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, get_args

import numpy as np
import torch

from parallelism.checks import check_positive_int
from parallelism.workloads.clicks.batch import ClickBatch

__all__ = [
    "CHUNK_LINES",
    "CRITEO_DENSE",
    "CRITEO_SPARSE",
    "Categorical",
    "CriteoFormat",
    "criteo_chunks",
    "criteo_format",
    "criteo_path",
    "read_criteo",
]

CRITEO_DENSE = 13
"""Integer (dense) features per Criteo line."""
CRITEO_SPARSE = 26
"""Categorical (sparse) features per Criteo line."""
Categorical = Literal["hash", "index"]
"""How a Criteo file names a categorical value's row (see `read_criteo`)."""
CHUNK_LINES = 8192
"""Criteo lines parsed at a time (about 2 MiB of arrays for Criteo's 39 features)."""


def read_criteo(
    path: str | os.PathLike[str],
    table_rows: Sequence[int],
    *,
    categorical: Categorical = "hash",
    dense_features: int = CRITEO_DENSE,
    max_lines: int | None = None,
    chunk_lines: int = CHUNK_LINES,
) -> ClickBatch:
    """Read a Criteo-format TSV file: ``label, dense..., categorical...`` per line.

    Dense (integer) values become ``log(1 + max(x, 0))`` as DLRM preprocesses them; an
    empty value is 0. Categorical values become rows of their table:

    - ``categorical="hash"`` (the raw Criteo files): a hexadecimal string, row
      ``int(value, 16) % table_rows[t]``; an empty value is row 0.
    - ``categorical="index"`` (preprocessed files): a decimal row index, which must lie in
      ``0..table_rows[t]-1``; an empty value is row 0.

    Lines end at ``\\n``, ``\\r\\n`` or ``\\r``; empty lines are skipped (and counted). The file
    is parsed ``chunk_lines`` lines at a time into compact arrays (about 4 + 4 * dense + 8 *
    tables bytes a sample, e.g. 264 for Criteo; the peak is twice that, while the chunks are
    joined), and the whole file is parsed before anything is returned, so a bad line leaves
    nothing half-read behind. For a file too large for memory use
    `ClickDataset.from_criteo`, which memory-maps a cache on disk.

    Args:
        path: the file.
        table_rows: rows of each categorical feature's table (26 for Criteo).
        categorical: ``"hash"`` or ``"index"``, as above.
        dense_features: integer features per line (13 for Criteo).
        max_lines: read at most this many lines.
        chunk_lines: lines parsed at a time.

    Raises:
        ValueError: for a missing or empty file, a bad argument, or a malformed line -- not
            UTF-8, a wrong number of fields, a label other than 0/1, a non-integer dense
            value, a non-hexadecimal (hash) or non-decimal (index) categorical value, or an
            index outside its table -- naming ``file:line`` and the feature.
    """
    fmt = criteo_format(table_rows, categorical, dense_features, max_lines)
    check_positive_int("chunk_lines", chunk_lines)
    chunks = list(criteo_chunks(criteo_path(path), fmt, chunk_lines))
    if not chunks:
        raise ValueError(f"Criteo file {path} holds no samples")
    labels, dense, sparse = (np.concatenate([c[i] for c in chunks]) for i in range(3))
    return ClickBatch(
        dense=torch.from_numpy(dense),
        sparse=torch.from_numpy(sparse),
        labels=torch.from_numpy(labels),
    )


@dataclass(frozen=True)
class CriteoFormat:
    """How to parse a Criteo file (`read_criteo`'s options), checked."""

    table_rows: tuple[int, ...]
    categorical: Categorical
    dense_features: int
    max_lines: int | None


def criteo_format(
    table_rows: Sequence[int], categorical: Categorical, dense_features: int, max_lines: int | None
) -> CriteoFormat:
    if categorical not in get_args(Categorical):
        raise ValueError(f"categorical must be 'hash' or 'index', got {categorical!r}")
    rows = tuple(table_rows)
    if not rows:
        raise ValueError("table_rows must name at least one table")
    for t, n in enumerate(rows):
        check_positive_int(f"table_rows[{t}]", n)
    if isinstance(dense_features, bool) or not isinstance(dense_features, int):
        raise ValueError(f"dense_features must be an integer, got {dense_features!r}")
    if dense_features < 0:
        raise ValueError(f"dense_features must be >= 0, got {dense_features}")
    if max_lines is not None:
        check_positive_int("max_lines", max_lines)
    return CriteoFormat(tuple(int(n) for n in rows), categorical, dense_features, max_lines)


def criteo_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"Criteo file {path} does not exist (resolved to {p.absolute()})")
    return p


# A lone "\r" ends a line too (as text mode with newline="" splits), but "\r\n" is one end.
_LONE_CR = re.compile(rb"(?<=\r)(?!\n)")

_Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]
"""``(labels [n] float32, dense [n, d] float32, sparse [n, tables] int64)``."""


def criteo_chunks(path: Path, fmt: CriteoFormat, chunk_lines: int) -> Iterator[_Chunk]:
    """The samples of a Criteo file, at most ``chunk_lines`` at a time, in file order.

    Raises:
        ValueError: for a malformed line, naming ``file:line`` (see `read_criteo`).
    """
    d, tables = fmt.dense_features, len(fmt.table_rows)
    fields = 1 + d + tables

    def fresh() -> _Chunk:
        return (
            np.empty(chunk_lines, dtype=np.float32),
            np.empty((chunk_lines, d), dtype=np.float32),
            np.empty((chunk_lines, tables), dtype=np.int64),
        )

    labels, dense, sparse = fresh()
    k = 0
    with path.open("rb") as handle:
        for number, raw in _numbered_lines(handle, fmt.max_lines):
            if not raw:
                continue
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{where}: invalid UTF-8 at byte {err.start + 1} of the line "
                    f"({raw[err.start : err.start + 4]!r}...); a Criteo file is UTF-8 text"
                ) from None
            parts = line.split("\t")
            if len(parts) != fields:
                raise ValueError(
                    f"{where}: {len(parts)} tab-separated fields, expected {fields} (label, "
                    f"{d} integer and {tables} categorical features)"
                )
            if parts[0] not in ("0", "1"):
                raise ValueError(f"{where}: label {parts[0]!r} is not 0 or 1")
            labels[k] = float(parts[0])
            dense[k] = _dense_values(parts[1 : 1 + d], where)
            sparse[k] = _categories(parts[1 + d :], fmt, where)
            k += 1
            if k == chunk_lines:
                yield labels, dense, sparse
                labels, dense, sparse = fresh()
                k = 0
    if k:
        yield labels[:k], dense[:k], sparse[:k]


def _numbered_lines(handle: BinaryIO, max_lines: int | None) -> Iterator[tuple[int, bytes]]:
    """``(line number, line without its end)`` for the first ``max_lines`` lines."""
    number = 0
    for raw in handle:
        for piece in _LONE_CR.split(raw) if b"\r" in raw else (raw,):
            if not piece:  # after a "\r" that ends the file
                continue
            number += 1
            if max_lines is not None and number > max_lines:
                return
            yield number, piece.rstrip(b"\r\n")


def _dense_values(texts: list[str], where: str) -> list[float]:
    try:
        return [math.log1p(max(int(text), 0)) if text else 0.0 for text in texts]
    except (ValueError, OverflowError):
        pass
    for j, text in enumerate(texts):  # find the bad one
        try:
            if text:
                math.log1p(max(int(text), 0))
        except ValueError:
            raise ValueError(
                f"{where}: integer feature I{j + 1} = {text!r} is not an integer"
            ) from None
        except OverflowError:
            raise ValueError(
                f"{where}: integer feature I{j + 1} = {text[:20]}... is too large for a float"
            ) from None
    raise AssertionError("unreachable: a value failed to parse, then parsed")


def _categories(texts: list[str], fmt: CriteoFormat, where: str) -> list[int]:
    rows = fmt.table_rows
    if fmt.categorical == "hash":
        try:
            return [int(text, 16) % n if text else 0 for text, n in zip(texts, rows, strict=True)]
        except ValueError:
            pass
    return [_category(text, rows[t], fmt.categorical, where, t) for t, text in enumerate(texts)]


def _category(text: str, rows: int, mode: str, where: str, table: int) -> int:
    if not text:
        return 0
    if mode == "hash":
        try:
            return int(text, 16) % rows
        except ValueError:
            raise ValueError(
                f"{where}: categorical feature C{table + 1} = {text!r} is not hexadecimal"
            ) from None
    try:
        value = int(text, 10)
    except ValueError:
        raise ValueError(
            f"{where}: categorical feature C{table + 1} = {text!r} is not a decimal row index"
        ) from None
    if not 0 <= value < rows:
        raise ValueError(
            f"{where}: categorical feature C{table + 1} = {value} is outside its table of "
            f"{rows} rows (0..{rows - 1}); pass larger table_rows or categorical='hash'"
        )
    return value
