"""What a cluster simulation produced: per-event logs and per-policy goodput and lost time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from simulations.analytics import mean_ci
from simulations.layout import Job
from simulations.policy_models import CAUSES

__all__ = ["EventLog", "SimulationResult", "StrategyResult", "straggler_table"]


@dataclass(frozen=True, kw_only=True, eq=False)
class EventLog:
    """Every failure event of every seed and what one strategy did about it."""

    action_names: tuple[str, ...]
    seed: np.ndarray
    time_s: np.ndarray
    component: np.ndarray
    """Kind code of the failed component (see ``simulations.traces.COMPONENTS``)."""
    first_gpu: np.ndarray
    num_gpus: np.ndarray
    action: np.ndarray
    """Index into :attr:`action_names`."""
    downtime_s: np.ndarray
    """Job-wide stall this event started (overlapping stalls are not double-counted in
    the per-cause totals)."""
    progress_lost_s: np.ndarray
    """Useful training time this event discarded (rollback, penalty, staleness)."""

    def __len__(self) -> int:
        return len(self.time_s)


@dataclass(frozen=True, kw_only=True, eq=False)
class StrategyResult:
    """One strategy's outcome, per Monte Carlo seed."""

    name: str
    exact: bool
    schedule: str
    """How its snapshots and checkpoints were scheduled."""
    horizon_s: float
    goodput: np.ndarray
    """Useful training time over wall time, per seed."""
    lost_s: dict[str, np.ndarray]
    """Wall time lost per cause (:data:`CAUSES`, and ``slow`` -- work not done while a
    straggler set the pace -- when stragglers were simulated), per seed; with the useful
    time they sum to the horizon."""
    actions: dict[str, np.ndarray]
    """Number of events per action, per seed."""
    events: EventLog | None = None

    def goodput_ci(self, level: float = 0.95) -> tuple[float, float, float]:
        """Mean goodput and its confidence interval over seeds."""
        return mean_ci(self.goodput, level)

    def lost_fraction(self) -> dict[str, float]:
        """Mean fraction of wall time lost per cause."""
        return {c: float(v.mean()) / self.horizon_s for c, v in self.lost_s.items()}

    def mean_actions(self) -> dict[str, float]:
        return {a: float(v.mean()) for a, v in self.actions.items()}


@dataclass(frozen=True, kw_only=True, eq=False)
class SimulationResult:
    """The outcome of :func:`simulate`: every strategy on the same failures."""

    job: Job
    horizon_s: float
    failures: str
    first_seed: int
    failures_per_seed: np.ndarray
    job_mtbf_s: float
    strategies: tuple[StrategyResult, ...]
    stragglers_per_seed: np.ndarray | None = None
    """Slow episodes per seed, when stragglers were simulated."""
    stragglers_handled_per_seed: np.ndarray | None = None
    """Of those, the ones mitigation replaced, when it was on."""

    @property
    def num_seeds(self) -> int:
        return len(self.failures_per_seed)

    def __getitem__(self, name: str) -> StrategyResult:
        for result in self.strategies:
            if result.name == name:
                return result
        raise KeyError(
            f"no strategy {name!r} in this result; have {[r.name for r in self.strategies]}"
        )

    def table(self, level: float = 0.95) -> str:
        """Goodput with its confidence interval and the percent of wall time lost per
        cause, one row per strategy."""
        head = (
            f"{self.job}, {self.horizon_s / 86400:g} days, {self.failures}\n"
            f"{self.num_seeds} seeds, {self.failures_per_seed.mean():,.1f} failures per seed "
            f"(job MTBF {self.job_mtbf_s / 3600:,.2f} h); lost time in % of wall time\n"
        )
        short = {
            "detection": "detect",
            "replacement": "replace",
            "transfer": "transfer",
            "lost_work": "lost work",
            "checkpoint": "ckpt",
            "convergence": "converge",
            "exhausted": "exhausted",
        }
        cols = f"{'strategy':<20}{'goodput':>8}  {f'{level:.0%} CI':<17}" + "".join(
            f"{short[c]:>10}" for c in CAUSES
        )
        rows = [cols, "-" * len(cols)]
        for r in self.strategies:
            m, lo, hi = r.goodput_ci(level)
            lost = r.lost_fraction()
            ci = f"[{lo:.4f}, {hi:.4f}]" if math.isfinite(lo) else "-"
            rows.append(
                f"{r.name:<20}{m:>8.4f}  {ci:<17}"
                + "".join(f"{100 * lost[c]:>10.3f}" for c in CAUSES)
            )
        rows.append("")
        rows.append("actions per seed (mean) and schedules:")
        for r in self.strategies:
            acts = (
                ", ".join(f"{a} {v:,.1f}" for a, v in r.mean_actions().items() if v > 0) or "none"
            )
            rows.append(f"  {r.name:<20}{acts}; {r.schedule}")
        return head + "\n".join(rows)

    def to_dict(self, level: float = 0.95) -> dict[str, Any]:
        """A JSON-ready summary (means and confidence intervals, no per-event data)."""
        out: dict[str, Any] = {
            "gpus": self.job.gpus,
            "layout": str(self.job.layout),
            "horizon_s": self.horizon_s,
            "failures": self.failures,
            "seeds": self.num_seeds,
            "failures_per_seed": float(self.failures_per_seed.mean()),
            "job_mtbf_s": self.job_mtbf_s,
            "strategies": {},
        }
        if self.stragglers_per_seed is not None:
            out["stragglers_per_seed"] = float(self.stragglers_per_seed.mean())
        if self.stragglers_handled_per_seed is not None:
            out["stragglers_handled_per_seed"] = float(self.stragglers_handled_per_seed.mean())
        for r in self.strategies:
            m, lo, hi = r.goodput_ci(level)
            out["strategies"][r.name] = {
                "exact": r.exact,
                "schedule": r.schedule,
                "goodput": m,
                "goodput_ci": [lo, hi],
                "lost_fraction": r.lost_fraction(),
                "actions_per_seed": r.mean_actions(),
            }
        return out

    @staticmethod
    def merge(results: Sequence[SimulationResult]) -> SimulationResult:
        """Concatenate results over disjoint seed ranges of one scenario (in order).

        Raises:
            ValueError: if the results are empty or describe different scenarios.
        """
        if not results:
            raise ValueError("nothing to merge")
        first = results[0]
        names = [r.name for r in first.strategies]
        for res in results[1:]:
            if (
                res.job != first.job
                or res.horizon_s != first.horizon_s
                or [r.name for r in res.strategies] != names
            ):
                raise ValueError("can only merge results of the same scenario")
        shifts = np.cumsum([0] + [r.num_seeds for r in results[:-1]])
        merged = []
        for k, base in enumerate(first.strategies):
            parts = [res.strategies[k] for res in results]
            logs = [p.events for p in parts]
            events = None
            if all(log is not None for log in logs):
                events = EventLog(
                    action_names=base.events.action_names,  # type: ignore[union-attr]
                    **{
                        name: np.concatenate(
                            [
                                getattr(log, name) + (shift if name == "seed" else 0)
                                for log, shift in zip(logs, shifts, strict=True)
                            ]
                        )
                        for name in (
                            "seed",
                            "time_s",
                            "component",
                            "first_gpu",
                            "num_gpus",
                            "action",
                            "downtime_s",
                            "progress_lost_s",
                        )
                    },
                )
            merged.append(
                replace(
                    base,
                    goodput=np.concatenate([p.goodput for p in parts]),
                    lost_s={c: np.concatenate([p.lost_s[c] for p in parts]) for c in base.lost_s},
                    actions={
                        a: np.concatenate([p.actions[a] for p in parts]) for a in base.actions
                    },
                    events=events,
                )
            )
        counts = np.concatenate([r.failures_per_seed for r in results])

        def joined(name: str) -> np.ndarray | None:
            parts = [getattr(r, name) for r in results]
            return None if any(p is None for p in parts) else np.concatenate(parts)

        return replace(
            first,
            failures_per_seed=counts,
            strategies=tuple(merged),
            stragglers_per_seed=joined("stragglers_per_seed"),
            stragglers_handled_per_seed=joined("stragglers_handled_per_seed"),
        )


def straggler_table(
    base: SimulationResult,
    unmitigated: SimulationResult,
    mitigated: SimulationResult,
    describe: str,
    level: float = 0.95,
) -> str:
    """Goodput per strategy without stragglers, with them left slow, and with them
    replaced (``[Note: straggler model]``), on the same failures and episodes; ``slow %``
    is the wall time the job spent working at a straggler's pace that it lost.

    Raises:
        ValueError: if the three results hold different strategies.
    """
    names = [r.name for r in base.strategies]
    for other in (unmitigated, mitigated):
        if [r.name for r in other.strategies] != names:
            raise ValueError("straggler comparison needs the same strategies in every result")
    per_seed = unmitigated.stragglers_per_seed
    handled = mitigated.stragglers_handled_per_seed
    head = (
        f"{describe}\n"
        f"{0.0 if per_seed is None else per_seed.mean():,.1f} slow episodes per seed, "
        f"{0.0 if handled is None else handled.mean():,.1f} of them long enough to be "
        f"replaced; goodput ({level:.0%} CI half-width)\n"
    )
    cols = (
        f"{'strategy':<20}{'no stragglers':>17}{'unmitigated':>17}{'slow %':>8}"
        f"{'mitigated':>17}{'slow %':>8}{'mitigation':>12}"
    )
    rows = [cols, "-" * len(cols)]

    def cell(r: StrategyResult) -> str:
        m, lo, hi = r.goodput_ci(level)
        half = (hi - lo) / 2 if math.isfinite(lo) else 0.0
        return f"{m:.4f} ± {half:.4f}"

    def slow(r: StrategyResult) -> str:
        lost = r.lost_s.get("slow")
        return "-" if lost is None else f"{100 * float(lost.mean()) / r.horizon_s:.2f}"

    for b, u, m in zip(base.strategies, unmitigated.strategies, mitigated.strategies, strict=True):
        gain = float(m.goodput.mean() - u.goodput.mean())
        rows.append(
            f"{b.name:<20}{cell(b):>17}{cell(u):>17}{slow(u):>8}{cell(m):>17}{slow(m):>8}"
            f"{gain:>+12.4f}"
        )
    return head + "\n".join(rows)
