"""The CheckFree study as a matrix: policies x failure rates x seeds, and its summaries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from recovery.names import Strategy
from simulations.convergence_config import (
    ConvergencePolicy,
    ConvergenceSetup,
    _non_negative,
    _positive_int,
)
from simulations.convergence_loop import _FAILOVER, run_convergence
from simulations.convergence_results import EvalRecord, RunResult
from simulations.costs import TimeModel, check_renamed
from simulations.failure_sources import FailureProcess

__all__ = [
    "SENSITIVITY_FIELDS",
    "ConvergenceExperiment",
    "RunKey",
    "display_rank",
    "exact_sensitivity",
    "steps_to_loss",
    "summarize",
]


@dataclass(frozen=True, kw_only=True)
class RunKey:
    """One cell of the experiment matrix."""

    strategy: ConvergencePolicy
    rate: float
    seed: int

    @property
    def file_name(self) -> str:
        """Result file name inside the output folder's ``runs/``."""
        safe = "".join(c if c.isalnum() or c in "-_+." else "_" for c in self.strategy.name)
        safe = safe.replace("+", "plus")
        if self.strategy.kind == "none":
            return f"none-s{self.seed}.json"
        return f"{safe}-r{self.rate:g}-s{self.seed}.json"


SENSITIVITY_FIELDS = ("checkpoint_write_s", "checkpoint_load_s", "failover_s", "redundant_factor")
"""`TimeModel` fields that only the exact strategies depend on."""


@dataclass(frozen=True, kw_only=True)
class ConvergenceExperiment:
    """The CheckFree study as a matrix: strategies x failure rates x seeds.

    `from_dict` reads the TOML layout of ``configs/checkfree.toml`` one to one: top-level
    keys are this class's fields, ``[model]`` is a `ConvergenceSetup`, ``[time]`` a
    `TimeModel`, ``strategies`` a list of `ConvergencePolicy.parse` strings and ``[[variant]]``
    tables extra CheckFree strategies with knobs (``label``, ``strategy``, `CheckFreeConfig`
    fields, optional ``rates``).

    Raises:
        ValueError: for an unknown key, an empty or invalid list, a bad target, or two
            strategies with the same name.
    """

    setup: ConvergenceSetup
    times: TimeModel
    steps: int
    """Committed steps per run."""
    eval_every: int = 25
    """Validation every this many committed steps."""
    seeds: tuple[int, ...] = (0,)
    """Each seed sets the initial weights, the data order and the failure draws."""
    rates: tuple[float, ...] = (0.05, 0.10, 0.16)
    """Failure rates per stage-hour."""
    strategies: tuple[ConvergencePolicy, ...]
    """Strategies compared at every rate (``none`` is always run once per seed)."""
    only_rates: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """ConvergencePolicy name -> the rates it runs at instead of ``rates`` (may include 0: the
    strategy's overhead without failures, e.g. CheckFree+'s swapped routes)."""
    target: float | None = None
    """Target validation loss; ``None``: `auto_target` of the no-failure run (per seed)."""
    target_fraction: float = 0.8
    """For the automatic target: the share of the steps at which the no-failure run's loss
    is the target."""
    derive_exact: bool = True
    """Replay exact strategies on the no-failure run instead of training them (see
    [Note: convergence simulator model])."""
    sensitivity: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """`TimeModel` field -> values at which the exact strategies (checkpointing, redundant
    computation) are re-timed by `exact_sensitivity`; only the fields that do not change
    the CheckFree runs: ``checkpoint_write_s``, ``checkpoint_load_s``, ``failover_s``,
    ``redundant_factor``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        object.__setattr__(self, "rates", tuple(float(r) for r in self.rates))
        object.__setattr__(self, "strategies", tuple(self.strategies))
        object.__setattr__(
            self, "only_rates", {k: tuple(float(r) for r in v) for k, v in self.only_rates.items()}
        )
        _positive_int("ConvergenceExperiment", "steps", self.steps)
        _positive_int("ConvergenceExperiment", "eval_every", self.eval_every)
        if not self.seeds or not self.rates or not self.strategies:
            raise ValueError("ConvergenceExperiment needs at least one seed, rate and strategy")
        for seed in self.seeds:
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ValueError(f"ConvergenceExperiment seeds must be >= 0 integers, got {seed!r}")
        for rate in (*self.rates, *(r for v in self.only_rates.values() for r in v)):
            FailureProcess(hourly_rate=rate)  # validates
        names = [s.name for s in self.strategies]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"strategy names must be unique; repeated: {duplicates}")
        unknown = sorted(set(self.only_rates) - set(names))
        if unknown:
            raise ValueError(f"only_rates names unknown strategies {unknown}")
        object.__setattr__(
            self,
            "sensitivity",
            {k: tuple(float(x) for x in v) for k, v in self.sensitivity.items()},
        )
        bad = sorted(set(self.sensitivity) - set(SENSITIVITY_FIELDS))
        if bad:
            raise ValueError(
                f"sensitivity can vary {', '.join(SENSITIVITY_FIELDS)} (they leave the CheckFree "
                f"runs unchanged), got {bad}"
            )
        for name, values in self.sensitivity.items():
            for value in values:
                dataclasses.replace(self.times, **{name: value})  # validates
        if self.target is not None:
            _non_negative("ConvergenceExperiment", "target", self.target, positive=True)
        if not 0 < self.target_fraction <= 1:
            raise ValueError(
                f"ConvergenceExperiment target_fraction must be in (0, 1], got "
                f"{self.target_fraction!r}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConvergenceExperiment:
        """Build from the parsed TOML (``kind`` and output keys already removed).

        Raises:
            ValueError: for unknown keys or invalid values (the message names them).
        """
        data = dict(data)
        model = dict(data.pop("model", {}))
        time_model = dict(data.pop("time", {}))
        variants = list(data.pop("variant", []))
        sensitivity = dict(data.pop("sensitivity", {}))
        strategy_texts = list(data.pop("strategies", ["checkfree", "checkfree+", "checkpoint:50"]))
        target = data.pop("target", "auto")
        check_renamed(sensitivity, "[sensitivity]", TimeModel.renamed)
        times = TimeModel.from_dict(time_model, "[time]")
        unknown = sorted(set(model) - set(ConvergenceSetup.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in [model]; known: "
                f"{sorted(ConvergenceSetup.__dataclass_fields__)}"
            )
        allowed = set(cls.__dataclass_fields__) - {
            "setup",
            "times",
            "strategies",
            "only_rates",
            "target",
            "sensitivity",
        }
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown top-level key(s) {unknown}; known: {sorted(allowed)}")
        if isinstance(target, str):
            if target != "auto":
                raise ValueError(f"target must be a number or 'auto', got {target!r}")
            target_value: float | None = None
        else:
            target_value = float(target)
        strategies = [ConvergencePolicy.parse(text) for text in strategy_texts]
        only_rates: dict[str, tuple[float, ...]] = {}
        for entry in variants:
            entry = dict(entry)
            base = entry.pop("strategy", None)
            if base is None or "label" not in entry:
                raise ValueError(f"a [[variant]] needs 'strategy' and 'label', got {entry!r}")
            rates = entry.pop("rates", None)
            strategy = ConvergencePolicy.parse(str(base), **entry)
            strategies.append(strategy)
            if rates is not None:
                only_rates[strategy.name] = tuple(rates)
        return cls(
            setup=ConvergenceSetup(**model),
            times=times,
            strategies=tuple(strategies),
            only_rates=only_rates,
            target=target_value,
            sensitivity=sensitivity,
            **data,
        )

    def baselines(self) -> list[RunKey]:
        """The no-failure run of every seed."""
        none = ConvergencePolicy(kind="none")
        return [RunKey(strategy=none, rate=0.0, seed=seed) for seed in self.seeds]

    def runs(self) -> list[RunKey]:
        """Every run with failures: strategies x their rates x seeds."""
        keys = []
        for seed in self.seeds:
            for strategy in self.strategies:
                if strategy.kind == "none":
                    continue
                for rate in self.only_rates.get(strategy.name, self.rates):
                    keys.append(RunKey(strategy=strategy, rate=rate, seed=seed))
        return keys

    def run(
        self,
        key: RunKey,
        *,
        baseline: RunResult | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Run one cell (exact strategies replay ``baseline`` when ``derive_exact``)."""
        return run_convergence(
            self.setup.with_seed(key.seed),
            key.strategy,
            FailureProcess(hourly_rate=key.rate, seed=key.seed),
            self.times,
            steps=self.steps,
            eval_every=self.eval_every,
            baseline=baseline if self.derive_exact else None,
            progress=progress,
        )


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def steps_to_loss(baseline: RunResult, loss: float) -> float | None:
    """How many steps the no-failure ``baseline`` needs to reach ``loss`` (interpolated
    between its evaluations), or ``None`` if it never does.

    ``run.steps - steps_to_loss(baseline, run.final_loss())`` is how many steps of
    progress a run's recoveries cost, in no-failure steps (``steps_behind`` in `summarize`).
    """
    prev: EvalRecord | None = None
    for record in baseline.records:
        if record.val_loss <= loss:
            if prev is None or prev.val_loss <= record.val_loss:
                return float(record.step)
            frac = (prev.val_loss - loss) / (prev.val_loss - record.val_loss)
            return prev.step + frac * (record.step - prev.step)
        prev = record
    return None


def display_rank(name: str) -> int:
    """Where a strategy goes in tables: none, CheckFree, CheckFree+, variants, redundant,
    best checkpointing, each checkpoint interval."""
    fixed = {"none": 0, "checkfree": 1, "checkfree+": 2, "redundant": 4, "checkpoint (best)": 5}
    if name in fixed:
        return fixed[name]
    return 6 if name.startswith("checkpoint-") else 3


def summarize(
    results: Sequence[RunResult],
    targets: Mapping[int, float],
) -> list[dict[str, Any]]:
    """One row per (strategy, rate): time to target (mean over seeds), failures, losses.

    ``steps_behind``: the no-failure steps' worth of progress the recoveries cost (how many
    fewer steps the no-failure run needs to reach this run's final loss); ``rebuilds``:
    stages rebuilt by CheckFree(+) (not rolled back).

    ``targets`` maps seed -> target loss. A row's ``time_to_target_h`` is the mean over
    the seeds that reached the target (``None`` if none did); ``reached`` counts them.
    Rows with ``strategy = "checkpoint (best)"`` take, per rate, the checkpoint interval
    with the smallest mean time. ``vs_best_checkpoint`` is that time divided by the row's
    (> 1: faster than the best checkpointing), ``vs_redundant`` likewise.
    """
    groups: dict[tuple[str, float], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.strategy, r.rate), []).append(r)
    baselines = {r.seed: r for r in results if r.strategy == "none"}

    def steps_behind(run: RunResult) -> float | None:
        base = baselines.get(run.seed)
        if base is None:
            return None
        reached = steps_to_loss(base, run.final_loss())
        return run.steps - reached if reached is not None else None

    rows: list[dict[str, Any]] = []
    for (name, rate), runs in groups.items():
        times = [r.time_to(targets[r.seed]) for r in runs]
        reached = [t for t in times if t is not None]
        rows.append(
            {
                "strategy": name,
                "rate": rate,
                "seeds": len(runs),
                "reached": len(reached),
                "time_to_target_h": (sum(reached) / len(reached) / 3600) if reached else None,
                "final_val_loss": sum(r.final_loss() for r in runs) / len(runs),
                "total_time_h": sum(r.total_time_s for r in runs) / len(runs) / 3600,
                "failures": sum(sum(len(e.stages) for e in r.events) for r in runs) / len(runs),
                "rollbacks": sum(sum(e.action == Strategy.ROLLBACK for e in r.events) for r in runs)
                / len(runs),
                "lost_steps": sum(sum(e.lost_steps for e in r.events) for r in runs) / len(runs),
                "steps_behind": _mean([steps_behind(r) for r in runs]),
                "rebuilds": sum(
                    sum(
                        len(e.stages)
                        for e in r.events
                        if e.action not in (Strategy.ROLLBACK, _FAILOVER)
                    )
                    for r in runs
                )
                / len(runs),
            }
        )
    for rate in sorted({row["rate"] for row in rows}):
        ckpts = [
            row
            for row in rows
            if row["rate"] == rate
            and row["strategy"].startswith("checkpoint-")
            and row["time_to_target_h"] is not None
        ]
        if ckpts:
            best = min(ckpts, key=lambda row: row["time_to_target_h"])
            rows.append({**best, "strategy": "checkpoint (best)", "best_of": best["strategy"]})
    for row in rows:
        peers = {r["strategy"]: r for r in rows if r["rate"] == row["rate"]}
        for column, ref in (
            ("vs_best_checkpoint", "checkpoint (best)"),
            ("vs_redundant", "redundant"),
        ):
            other = peers.get(ref, {}).get("time_to_target_h")
            mine = row["time_to_target_h"]
            row[column] = other / mine if other is not None and mine else None
    rows.sort(key=lambda row: (row["rate"], display_rank(row["strategy"]), row["strategy"]))
    return rows


def exact_sensitivity(
    experiment: ConvergenceExperiment,
    baselines: Mapping[int, RunResult],
    targets: Mapping[int, float],
) -> list[dict[str, Any]]:
    """Time to target of the exact strategies as one cost of `experiment.sensitivity` varies.

    Each exact strategy (checkpointing, redundant computation) is re-timed on the no-failure
    ``baselines`` (by seed) at every value; a row per (field, value, rate, strategy) holds the
    mean time over the seeds that reach ``targets[seed]`` (``None`` if none does), plus a
    ``"checkpoint (best)"`` row per (field, value, rate).
    """
    rows: list[dict[str, Any]] = []
    exact = [s for s in experiment.strategies if s.exact and s.kind != "none"]
    for name, values in experiment.sensitivity.items():
        for value in values:
            times = dataclasses.replace(experiment.times, **{name: value})
            for rate in experiment.rates:
                group: list[dict[str, Any]] = []
                for strategy in exact:
                    reached = []
                    for seed, base in baselines.items():
                        run = run_convergence(
                            experiment.setup.with_seed(seed),
                            strategy,
                            FailureProcess(hourly_rate=rate, seed=seed),
                            times,
                            steps=experiment.steps,
                            eval_every=experiment.eval_every,
                            baseline=base,
                        )
                        t = run.time_to(targets[seed])
                        if t is not None:
                            reached.append(t)
                    hours = sum(reached) / len(reached) / 3600 if reached else None
                    group.append(
                        {"field": name, "value": value, "rate": rate, "strategy": strategy.name,
                         "time_to_target_h": hours}
                    )  # fmt: skip
                ckpts = [
                    g for g in group
                    if g["strategy"].startswith("checkpoint-") and g["time_to_target_h"] is not None
                ]  # fmt: skip
                if ckpts:
                    best = min(ckpts, key=lambda g: g["time_to_target_h"])
                    group.append(
                        {**best, "strategy": "checkpoint (best)", "best_of": best["strategy"]}
                    )
                rows.extend(group)
    return rows
