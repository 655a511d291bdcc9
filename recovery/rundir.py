"""The run folder every job writes: metrics, events, summary and a loss plot.

Layout::

    <run>/config.json      what was run (topology, spec, policy, failures)
    <run>/metrics.jsonl    one line per committed step (with its validation loss, if evaluated)
    <run>/events.jsonl     one line per failure and recovery
    <run>/summary.json     totals at the end
    <run>/loss.png         loss vs wall-clock time, failures and recoveries marked
    <run>/tensorboard/     TensorBoard event files, with the tensorboard extra
                           (recovery/callbacks/tensorboard.py; docs/metrics.md)

Lines are appended and flushed as they happen, so a run killed half-way still leaves a
readable record. They are not fsynced (one per step would cost more than the record is
worth), so a power loss or a full disk can leave the last line torn: reading skips it with
a warning, and the next append cuts it off first, so the files stay one JSON record per
line (a torn line anywhere else is an error). `plot_loss` draws ``loss.png`` from the
metrics and events records.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recovery.names import Strategy

log = logging.getLogger(__name__)


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
        """Append one JSON line to ``name`` and flush it (after cutting off a torn last
        line: see the module docstring)."""
        self._create()
        with self.file(name).open("a+b") as fh:
            _end_clean(fh, self.file(name))
            fh.write((dumps(record) + "\n").encode())

    def read_lines(self, name: str) -> list[dict[str, Any]]:
        """All JSON lines of ``name`` (empty if the file does not exist); a torn last line
        is skipped with a warning.

        Raises:
            ValueError: naming the file and the line, if a line before the last is not a
                JSON record.
        """
        target = self.file(name)
        if not target.exists():
            return []
        lines = [(n, line) for n, line in enumerate(target.read_text().splitlines(), 1)]
        lines = [(n, line) for n, line in lines if line.strip()]
        records = []
        for i, (n, line) in enumerate(lines):
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"a {type(record).__name__}, not an object")
            except ValueError as exc:
                if i == len(lines) - 1:
                    log.warning(
                        "%s: skipping its torn last line %d (%s), left by a crash mid-write",
                        target,
                        n,
                        exc,
                    )
                    break
                raise ValueError(
                    f"{target}: line {n} is not a JSON record ({exc}); only the last line can "
                    "be torn by a crash, so the file was edited or damaged: fix or remove that line"
                ) from None
            records.append(record)
        return records


def _end_clean(fh: Any, path: Path) -> None:
    """Make the file open in ``fh`` (binary, appending) end with a whole line: a last line
    without its newline was cut short by a crash (`RunDir.append` writes each line with its
    newline at once) and is cut off -- unless it is a whole record, which gets its newline."""
    size = fh.seek(0, os.SEEK_END)
    if size == 0:
        return
    fh.seek(size - 1)
    if fh.read(1) == b"\n":
        return
    fh.seek(0)
    data = fh.read()
    start = data.rfind(b"\n") + 1
    tail = data[start:]
    try:
        json.loads(tail)
    except ValueError:
        log.warning(
            "%s: cutting off its torn last line (%d bytes) before appending", path, len(tail)
        )
        fh.truncate(start)
    else:
        fh.write(b"\n")


def plot_loss(
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
) -> None:
    """Write a PNG of training (and validation) loss against wall-clock seconds.

    ``metrics`` are ``metrics.jsonl`` records (``time``, ``loss``, optionally ``val_loss``);
    ``events`` are ``events.jsonl`` records (``time``, ``seconds``, ``strategy``). Each
    failure is a red dashed line at the time it was detected, with its recovery span shaded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    train = [(m["time"], m["loss"]) for m in metrics if m.get("loss") is not None]
    if train:
        xs, ys = zip(*train, strict=True)
        ax.plot(xs, ys, lw=1.2, label="train loss")
    val = [(m["time"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
    if val:
        xs, ys = zip(*val, strict=True)
        ax.plot(xs, ys, "o-", ms=3, lw=1.0, label="validation loss")
    labelled: set[str] = set()
    for event in events:
        start = float(event.get("time", 0.0))
        span = float(event.get("seconds", 0.0))
        strategy = str(event.get("strategy", "failure"))
        label = f"failure -> {strategy}" if strategy not in labelled else None
        labelled.add(strategy)
        color = "tab:red" if strategy == Strategy.ROLLBACK else "tab:orange"
        ax.axvline(start, color=color, ls="--", lw=1.0, label=label)
        if span > 0:
            ax.axvspan(start, start + span, color=color, alpha=0.15)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
