"""The run folder every job writes: metrics, events, summary and a loss plot.

Layout::

    <run>/config.json      what was run (topology, spec, policy, failures)
    <run>/metrics.jsonl    one line per committed step (and per evaluation)
    <run>/events.jsonl     one line per failure and recovery
    <run>/summary.json     totals at the end
    <run>/loss.png         loss vs wall-clock time, failures and recoveries marked

Lines are appended and flushed as they happen, so a run killed half-way still leaves a
readable record.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _json_default(obj: object) -> object:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    return repr(obj)


def dumps(obj: object) -> str:
    """JSON for run-folder files (dataclasses with ``to_dict`` and paths are handled)."""
    return json.dumps(obj, default=_json_default, sort_keys=False)


class RunDir:
    """A run folder, created when the first file is written into it -- so a run refused
    for bad input leaves no folder behind.

    Raises:
        ValueError: if ``path`` exists and is not a directory.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"run folder {self.path} exists and is not a directory")

    def _create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    @classmethod
    def new(cls, base: str | os.PathLike[str] = "runs", name: str = "run") -> RunDir:
        """A fresh folder ``<base>/<timestamp>-<name>``."""
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path(base) / f"{stamp}-{name}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = Path(base) / f"{stamp}-{name}-{suffix}"
        return cls(path)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_json(self, name: str, payload: Mapping[str, Any]) -> Path:
        """Write ``payload`` to ``name`` atomically (temp file, then rename)."""
        self._create()
        target = self.file(name)
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(json.dumps(payload, default=_json_default, indent=2) + "\n")
        os.replace(tmp, target)
        return target

    def append(self, name: str, record: Mapping[str, Any]) -> None:
        """Append one JSON line to ``name`` and flush it."""
        self._create()
        with self.file(name).open("a") as fh:
            fh.write(dumps(record) + "\n")

    def read_lines(self, name: str) -> list[dict[str, Any]]:
        """All JSON lines of ``name`` (empty if the file does not exist)."""
        target = self.file(name)
        if not target.exists():
            return []
        return [json.loads(line) for line in target.read_text().splitlines() if line.strip()]
