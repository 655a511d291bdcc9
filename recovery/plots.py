"""Loss-vs-wall-clock plots with failures and recoveries marked."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from recovery.names import Strategy


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
