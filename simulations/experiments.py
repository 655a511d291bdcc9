"""Failure-injection experiment matrices: for real on the Ray runtime, or in the cluster simulator.

Two kinds of `scripts/experiment.py` TOML files live here (the convergence study is in
``simulations/convergence.py``):

``kind = "runtime"`` -- strategies x failure rates x seeds x models, each cell a real
training job on the Ray runtime with Poisson worker kills (`FailureSchedule.poisson`). Per
run: wall time, goodput (the failure-free time of the same steps over the wall time), time
lost per cause (the recovery phases, redone steps, and the rest: checkpoint/snapshot
overhead), loss curve and failures. Outputs ``results.csv``/``results.json``, a markdown
table, and plots: loss vs wall-clock with failures marked, goodput per strategy and rate,
time lost per cause.

``kind = "simulator"`` -- cluster sizes x strategies in `simulations.cluster`, optionally
with costs measured here (``calibration = "file.json"``, written by
``scripts/bench.py recovery --calibration``). Outputs the goodput table and the plots
goodput vs cluster size per strategy and time lost per cause.

Both are resumable: a cell whose result file exists is loaded, not re-run.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("detect", "replace", "reform", "transfer", "resume")
CAUSES = (*PHASES, "redone steps", "overhead")


# ---- kind = "runtime" ---------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeCell:
    strategy: str
    rate: float
    seed: int
    model: str

    @property
    def name(self) -> str:
        return f"{self.model}-{self.strategy}-rate{self.rate:g}-seed{self.seed}"


def _policy(settings: Mapping[str, Any]) -> Any:
    """A ``[policies.<name>]`` table as a `RecoveryPolicy`: its keys are the policy's fields,
    each part a table of its own (``[policies.<name>.baseline] checkpoint_every = 20``);
    a key by an old flat name is refused naming its home (`recovery.policy.RENAMED`)."""
    from recovery.policy import RecoveryPolicy

    return RecoveryPolicy(**dict(settings))


def runtime_cells(data: Mapping[str, Any]) -> list[RuntimeCell]:
    """The matrix of a runtime experiment, validated.

    Raises:
        ValueError: for a missing or malformed field.
    """
    policies = data.get("policies")
    if not isinstance(policies, Mapping) or not policies:
        raise ValueError("a runtime experiment needs [policies.<name>] tables (at least one)")
    for name, settings in policies.items():
        try:
            _policy(settings)
        except (TypeError, ValueError) as err:
            raise ValueError(f"policies.{name}: {err}") from None
    rates = list(data.get("rates", []))
    if not rates or any(not (isinstance(r, int | float) and 0 <= r <= 1) for r in rates):
        raise ValueError(
            f"rates must be a non-empty list of kill probabilities per worker-step, got {rates!r}"
        )
    seeds = list(data.get("seeds", [0]))
    models = list(data.get("models", ["tiny"]))
    return [
        RuntimeCell(s, float(r), int(seed), m)
        for m in models
        for s in policies
        for r in rates
        for seed in seeds
    ]


def run_runtime_cell(data: Mapping[str, Any], cell: RuntimeCell) -> dict[str, Any]:
    """Train one cell of the matrix for real and measure it."""
    from parallelism import Topology
    from parallelism.workloads.llama_spec import llama_spec
    from recovery import Trainer
    from recovery.faults import FailureSchedule

    job = dict(data.get("job", {}))
    steps = int(data.get("steps", 50))
    topology = Topology(int(job.pop("stages", 4)), int(job.pop("replicas", 2)))
    overrides = dict(data.get("model_overrides", {}).get(cell.model, {}))
    spec = llama_spec(preset=cell.model, seed=cell.seed, **job, **overrides)
    failures = FailureSchedule.poisson(topology, steps, cell.rate, seed=cell.seed)
    policy = _policy(data["policies"][cell.strategy])
    start = time.perf_counter()
    result = Trainer(
        spec, topology=topology, policy=policy, failures=failures, collect_states=False
    ).fit(steps)
    total = time.perf_counter() - start
    recovering = [(e.time, e.time + e.seconds) for e in result.events]
    clean = [
        m["step_s"]
        for m in result.metrics
        if not any(a <= m["time"] <= b + m["step_s"] for a, b in recovering)
    ] or [m["step_s"] for m in result.metrics]
    step_s = statistics.median(clean)
    lost = {p: sum(e.breakdown.get(p, 0.0) for e in result.events) for p in PHASES}
    lost["redone steps"] = sum(e.lost_steps for e in result.events) * step_s
    lost["overhead"] = max(0.0, result.wall_s - steps * step_s - sum(lost.values()))
    return {
        "strategy": cell.strategy,
        "rate": cell.rate,
        "seed": cell.seed,
        "model": cell.model,
        "steps": steps,
        "failures": len(failures),
        "recoveries": len(result.events),
        "wall_s": result.wall_s,
        "startup_s": result.startup_s,
        "total_s": total,
        "step_s": step_s,
        "goodput": steps * step_s / result.wall_s if result.wall_s > 0 else math.nan,
        "lost_s": lost,
        "lost_steps": sum(e.lost_steps for e in result.events),
        "final_loss": sum(result.losses[-5:]) / len(result.losses[-5:]),
        "curve": [(m["time"], m["loss"]) for m in result.metrics],
        "events": [
            {"time": e.time, "seconds": e.seconds, "strategy": e.strategy} for e in result.events
        ],
    }


def run_runtime_kind(
    data: Mapping[str, Any],
    out: Path,
    figures: Path | None,
    *,
    force: bool = False,
    report_only: bool = False,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run (or load) every cell, then write the table and the plots. Returns the rows."""
    cells = runtime_cells(data)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if force or not (runs / f"{c.name}.json").exists()]
    if not report_only and todo:
        from tqdm import tqdm

        for cell in tqdm(todo, desc="runs", unit="run", disable=not progress):
            _write_json(runs / f"{cell.name}.json", run_runtime_cell(data, cell))
    rows = [
        json.loads((runs / f"{c.name}.json").read_text())
        for c in cells
        if (runs / f"{c.name}.json").exists()
    ]
    _runtime_outputs(rows, out, figures, simulated_goodput(data, rows))
    return rows


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def simulated_goodput(
    data: Mapping[str, Any], rows: list[dict[str, Any]]
) -> dict[tuple[str, float], float]:
    """The simulator's goodput for each (strategy, rate) of a runtime experiment.

    The ``[simulate]`` table names a calibration file (``scripts/bench.py recovery
    --calibration``) and, per policy, the simulator strategy that models it
    (``[simulate.as.<policy>]`` with ``strategy`` and its options). The simulated job is
    the real one: ``pp = stages``, ``dp = replicas``, one GPU per worker on one node,
    exponential worker failures at the real per-step kill rate, the real steps' median
    time, over the real runs' mean wall time.
    """
    from simulations.cluster import (
        CheckpointRestart,
        Job,
        Layout,
        SnapshotPolicy,
        make_policy_model,
        simulate,
    )
    from simulations.costs import CostModel
    from simulations.traces import ExponentialFailures

    sim = data.get("simulate")
    if not sim:
        return {}
    base = CostModel.from_json(sim["calibration"])
    job_cfg = data.get("job", {})
    stages, replicas = int(job_cfg.get("stages", 4)), int(job_cfg.get("replicas", 2))
    layout = Layout(pp=stages, dp=replicas, tp=1)
    job = Job(gpus=layout.gpus, layout=layout, gpus_per_node=layout.gpus)
    out: dict[tuple[str, float], float] = {}
    for (strategy, rate), rs in _groups(rows).items():
        model = dict(sim.get("as", {}).get(strategy, {}))
        if not model or rate <= 0:
            continue
        step_s = _mean([r["step_s"] for r in rs])
        name = model.pop("strategy")
        if name == CheckpointRestart.name:
            chosen = CheckpointRestart(interval_s=float(model.pop("checkpoint_every")) * step_s)
        else:
            every = model.pop("snapshot_every", None)
            chosen = make_policy_model(
                name, snapshots=SnapshotPolicy(every_steps=every, durable_every_s=None), **model
            )
        costs = CostModel.from_dict({**base.__dict__, "step_s": step_s})
        failures = ExponentialFailures(mtbf_hours=step_s / rate / 3600.0)
        horizon = _mean([r["wall_s"] for r in rs])
        result = simulate(
            job, failures, [chosen], horizon_s=horizon, costs=costs, seeds=200, keep_events=False
        )
        out[(strategy, rate)] = result[chosen.name].goodput_ci()[0]
    return out


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["strategy"], r["rate"]), []).append(r)
    return groups


def _runtime_outputs(
    rows: list[dict[str, Any]],
    out: Path,
    figures: Path | None,
    simulated: Mapping[tuple[str, float], float] | None = None,
) -> None:
    flat = [
        {k: v for k, v in r.items() if k not in ("curve", "events", "lost_s")}
        | {f"lost_{c.replace(' ', '_')}_s": r["lost_s"][c] for c in CAUSES}
        for r in rows
    ]
    _write_csv(out / "results.csv", flat)
    _write_json(out / "results.json", flat)
    simulated = simulated or {}
    lines = [
        "| strategy | kill rate / worker-step | runs | failures | goodput | simulated goodput "
        "| wall (s) | lost steps | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (strategy, rate), rs in sorted(_groups(rows).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        sim = simulated.get((strategy, rate))
        lines.append(
            f"| {strategy} | {rate:g} | {len(rs)} | {_mean([r['failures'] for r in rs]):.1f} | "
            f"{_mean([r['goodput'] for r in rs]):.3f} | {'-' if sim is None else f'{sim:.3f}'} | "
            f"{_mean([r['wall_s'] for r in rs]):.1f} | "
            f"{_mean([r['lost_steps'] for r in rs]):.1f} | {_mean([r['final_loss'] for r in rs]):.3f} |"
        )
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    print(table)
    paths = _runtime_plots(rows, out)
    _copy(paths, figures)


def _runtime_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    strategies = sorted({r["strategy"] for r in rows})
    rates = sorted({r["rate"] for r in rows})
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}

    # loss vs wall-clock, failures marked: the first seed at the highest rate
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    top = max(rates)
    for s in strategies:
        runs = sorted(
            (r for r in rows if r["strategy"] == s and r["rate"] == top), key=lambda r: r["seed"]
        )
        if not runs:
            continue
        run = runs[0]
        xs, ys = zip(*run["curve"], strict=True) if run["curve"] else ((), ())
        ax.plot(xs, ys, color=colors[s], lw=1.2, label=f"{s} ({run['recoveries']} failures)")
        for e in run["events"]:
            ax.axvline(e["time"], color=colors[s], ls="--", lw=0.8, alpha=0.7)
            ax.axvspan(e["time"], e["time"] + e["seconds"], color=colors[s], alpha=0.08)
    ax.set(
        xlabel="wall-clock time (s)",
        ylabel="training loss",
        title=f"loss vs time, kill rate {top:g}/worker-step (dashed: failures)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "runtime_loss_vs_time.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    # goodput per strategy and rate, and time lost per cause
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    width = 0.8 / max(1, len(strategies))
    for i, s in enumerate(strategies):
        means = [
            _mean([r["goodput"] for r in rows if r["strategy"] == s and r["rate"] == rate])
            for rate in rates
        ]
        a1.bar([k + i * width for k in range(len(rates))], means, width, color=colors[s], label=s)
    a1.set_xticks(
        [k + width * (len(strategies) - 1) / 2 for k in range(len(rates))],
        [f"{r:g}" for r in rates],
    )
    a1.set(
        xlabel="kill probability per worker-step", ylabel="goodput", ylim=(0, 1.05), title="goodput"
    )
    a1.legend(fontsize=8)
    bottom = [0.0] * len(strategies)
    for k, cause in enumerate(CAUSES):
        vals = [
            _mean([r["lost_s"][cause] for r in rows if r["strategy"] == s and r["rate"] == top])
            for s in strategies
        ]
        a2.bar(strategies, vals, bottom=bottom, color=f"C{k}", label=cause)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    a2.set(ylabel="seconds lost per run", title=f"time lost per cause (rate {top:g})")
    a2.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "runtime_goodput.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


# ---- kind = "simulator" -------------------------------------------------------------------


def run_simulator_kind(
    data: Mapping[str, Any], out: Path, figures: Path | None, *, progress: bool = True
) -> list[dict[str, Any]]:
    """Simulate each cluster size for every strategy; write the table and plots.

    Raises:
        ValueError: for a malformed matrix (sizes and layouts must pair up).
    """
    from simulations.cluster import POLICY_MODELS, Job, Layout, simulate
    from simulations.costs import CostModel
    from simulations.traces import llama3_failures

    layouts = [Layout.parse(text) for text in data.get("layouts", [])]
    if not layouts:
        raise ValueError('a simulator experiment needs layouts = ["pp=..,dp=..,tp=..", ...]')
    days = float(data.get("days", 54))
    seeds = int(data.get("seeds", 100))
    names = data.get("strategies", "all")
    strategies = list(POLICY_MODELS) if names == "all" else list(names)
    costs = CostModel.from_json(data["calibration"]) if data.get("calibration") else CostModel()
    rows: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    for layout in layouts:
        job = Job(gpus=layout.gpus, layout=layout)
        start = time.perf_counter()
        result = simulate(
            job,
            llama3_failures(),
            strategies,
            horizon_s=days * 86400,
            costs=costs,
            seeds=seeds,
            keep_events=False,
        )
        elapsed = time.perf_counter() - start
        for name in strategies:
            r = result[name]
            mean, low, high = r.goodput_ci()
            rows.append(
                {
                    "gpus": layout.gpus,
                    "layout": str(layout),
                    "strategy": name,
                    "goodput": mean,
                    "ci_low": low,
                    "ci_high": high,
                    "seconds": elapsed,
                    **{f"lost_{c}": v for c, v in r.lost_fraction().items()},
                }
            )
    _write_csv(out / "results.csv", rows)
    _write_json(out / "results.json", rows)
    _copy(_simulator_plots(rows, out), figures)
    return rows


def _simulator_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = sorted(
        {r["strategy"] for r in rows}, key=lambda s: [r["strategy"] for r in rows].index(s)
    )
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    for i, s in enumerate(strategies):
        mine = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["gpus"])
        a1.errorbar(
            [r["gpus"] for r in mine],
            [r["goodput"] for r in mine],
            yerr=[
                [r["goodput"] - r["ci_low"] for r in mine],
                [r["ci_high"] - r["goodput"] for r in mine],
            ],
            marker="o",
            ms=4,
            capsize=3,
            color=f"C{i}",
            label=s,
        )
    a1.set(
        xscale="log",
        xlabel="GPUs",
        ylabel="goodput",
        title="goodput vs cluster size (Llama 3 failure rate)",
    )
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    largest = max(r["gpus"] for r in rows)
    biggest = [r for r in rows if r["gpus"] == largest]
    causes = [k for k in biggest[0] if k.startswith("lost_")]
    bottom = [0.0] * len(biggest)
    for k, cause in enumerate(causes):
        vals = [r[cause] for r in biggest]
        a2.bar(
            [r["strategy"] for r in biggest],
            vals,
            bottom=bottom,
            color=f"C{k}",
            label=cause.removeprefix("lost_"),
        )
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    a2.set(ylabel="fraction of wall time lost", title=f"time lost per cause at {largest:,} GPUs")
    a2.tick_params(axis="x", rotation=30)
    a2.legend(fontsize=7)
    fig.tight_layout()
    path = out / "simulated_goodput.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


# ---- shared -------------------------------------------------------------------------------


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _copy(paths: list[Path], figures: Path | None) -> None:
    if figures is None:
        return
    figures.mkdir(parents=True, exist_ok=True)
    for p in paths:
        (figures / p.name).write_bytes(p.read_bytes())
