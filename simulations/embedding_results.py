"""What the embedding simulator reports: each failure's event, each run's result, and the
table and plot `scripts/embedding_experiment.py` writes (see [Note: embedding simulator
model] in ``simulations/embedding.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from recovery.names import Strategy
from simulations.policies import SimulatedPolicy

__all__ = ["EmbeddingEvent", "EmbeddingRunResult", "plot_results", "results_table"]


@dataclass(frozen=True)
class EmbeddingEvent:
    """One failure and what its recovery did."""

    step: int
    """Committed steps when the worker(s) died."""
    lost: tuple[int, ...]
    """Dead worker ranks."""
    decision: str
    """`SimulatedPolicy.PARTIAL` (survivors kept their state) or `Strategy.ROLLBACK`."""
    rows_exact: int = 0
    rows_stale: int = 0
    rows_from_mirror: int = 0
    lost_samples: float = 0.0
    """Lost lookups over lookups per sample (see [Note: portion of lost samples])."""
    pls_event: float = 0.0
    pls_job: float = 0.0
    """The job's PLS had the event been accepted."""
    downtime_s: float = 0.0
    """Modelled stall: detection, replacement, state transfer or reload."""
    redo_steps: int = 0
    """Committed steps thrown away by a rollback."""


@dataclass
class EmbeddingRunResult:
    """What one strategy's run produced."""

    strategy: str
    recovery: str
    checkpoint_every: int | None
    auc: float
    log_loss: float
    curve: list[tuple[int, float, float, float]]
    """``(committed steps, modelled seconds, AUC, log loss)`` at each evaluation."""
    events: list[EmbeddingEvent]
    total_s: float
    """Modelled wall-clock time of the run."""
    lost: dict[str, float]
    """Modelled seconds lost, by cause: checkpoint, failed_step, recovery, redo, mirror."""
    pls: float
    """The job's final PLS (accepted partial recoveries only)."""
    mirror_bytes_per_step: float
    mirror_memory_bytes: int
    compute_s: float
    """Measured seconds of training and recovery compute on this machine."""
    digest: str
    """SHA-256 of the final tables and dense weights (equal iff bit-identical)."""

    @property
    def lost_s(self) -> float:
        return sum(self.lost.values())

    @property
    def rollbacks(self) -> int:
        return sum(e.decision == Strategy.ROLLBACK for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["lost_s"] = self.lost_s
        out["rollbacks"] = self.rollbacks
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EmbeddingRunResult:
        """Read back `to_dict`'s output (e.g. a ``results.json`` entry).

        Raises:
            ValueError: if a field is missing or unknown.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k not in ("lost_s", "rollbacks")}
        if set(fields) != known:
            raise ValueError(
                f"not an embedding run result: missing {sorted(known - set(fields))}, "
                f"unknown {sorted(set(fields) - known)}"
            )
        fields["curve"] = [tuple(c) for c in fields["curve"]]
        fields["events"] = [
            EmbeddingEvent(**{**e, "lost": tuple(e["lost"])}) for e in fields["events"]
        ]
        return cls(**fields)


def results_table(results: Sequence[EmbeddingRunResult], *, reference: str | None = None) -> str:
    """A markdown table: accuracy, time and what the recoveries did, one row per strategy.

    ``reference`` names the no-failure run that ``dAUC`` and "bit-exact" compare with
    (default: the first run with recovery ``none``).
    """
    ref = next(
        (
            r
            for r in results
            if (r.strategy == reference if reference else r.recovery == SimulatedPolicy.NONE)
        ),
        None,
    )
    rollback = next((r for r in results if r.recovery == Strategy.ROLLBACK), None)
    header = (
        "| strategy | ckpt every | AUC | dAUC | log loss | time (s) | lost (s) | "
        "lost vs rollback | rollbacks | rows exact / stale (accepted) | PLS | mirror KB/step | "
        "mirror MB | bit-exact | compute (s) |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        accepted = [e for e in r.events if e.decision == SimulatedPolicy.PARTIAL]
        exact = sum(e.rows_exact for e in accepted)
        stale = sum(e.rows_stale for e in accepted)
        d_auc = f"{r.auc - ref.auc:+.4f}" if ref else "-"
        vs = (
            f"{r.lost_s / rollback.lost_s:.2f}x"
            if rollback is not None and rollback.lost_s > 0
            else "-"
        )
        bit = "-" if ref is None or r is ref else ("yes" if r.digest == ref.digest else "no")
        lines.append(
            f"| {r.strategy} | {r.checkpoint_every or '-'} | {r.auc:.4f} | {d_auc} | "
            f"{r.log_loss:.4f} | {r.total_s:.0f} | {r.lost_s:.0f} | {vs} | {r.rollbacks} | "
            f"{exact} / {stale} | {r.pls:.4f} | {r.mirror_bytes_per_step / 1e3:.1f} | "
            f"{r.mirror_memory_bytes / 1e6:.1f} | {bit} | {r.compute_s:.0f} |"
        )
    return "\n".join(lines)


def plot_results(results: Sequence[EmbeddingRunResult], path: str, *, title: str = "") -> None:
    """Two panels: held-out AUC against modelled time (failures marked), and lost time by
    cause per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110)
    for i, r in enumerate(results):
        color = f"C{i}"
        xs = [c[1] for c in r.curve]
        ys = [c[2] for c in r.curve]
        ax.plot(xs, ys, "-", lw=1.3, color=color, label=f"{r.strategy} (AUC {r.auc:.4f})")
    ax.set_xlabel("modelled wall-clock time (s)")
    ax.set_ylabel("held-out AUC")
    lo = min(min(c[2] for c in r.curve[1:]) for r in results if len(r.curve) > 1)
    hi = max(max(c[2] for c in r.curve) for r in results)
    ax.set_ylim(max(lo, hi - 0.08), hi + 0.005)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    causes = ("checkpoint", "failed_step", "recovery", "redo", "mirror")
    bottom = np.zeros(len(results))
    names = [r.strategy for r in results]
    for j, cause in enumerate(causes):
        values = np.array([r.lost.get(cause, 0.0) for r in results])
        bx.bar(names, values, bottom=bottom, color=f"C{j}", label=cause.replace("_", " "))
        bottom += values
    bx.set_ylabel("modelled time lost (s)")
    bx.tick_params(axis="x", labelrotation=20, labelsize=8)
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
