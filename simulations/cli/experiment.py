"""Run a failure-injection experiment matrix described by a TOML file; write tables and plots.

    checkfree experiment configs/checkfree.toml
    checkfree experiment configs/checkfree-smoke.toml --out /tmp/cf --jobs 2
    checkfree experiment configs/runtime-smoke.toml --out /tmp/runtime-smoke
    checkfree experiment configs/checkfree.toml --report-only

The TOML's top-level ``kind`` names the experiment; each kind is one runner in ``RUNNERS``
(``"convergence"``: the CheckFree study, `simulations.convergence`; ``"runtime"``:
real failure-injection runs on Ray, and ``"simulator"``: the cluster-scale simulator, both
in `simulations.experiments`). Runs are
resumable: a run whose result file exists in ``<out>/runs/`` is loaded, not re-run.
Outputs in ``<out>``: ``results.csv`` and ``results.json`` (one row per strategy and
rate), ``time_to_target.md`` (the table, also printed), and the plots (also copied to the
TOML's ``figures`` folder if it names one). The TOML files of configs/ are in the
checkout; in it, ``python scripts/experiment.py`` is the same program.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from recovery.cli.help import HelpFormatter
from simulations.convergence import (
    ConvergenceExperiment,
    RunKey,
    RunResult,
    auto_target,
    display_rank,
    exact_sensitivity,
    summarize,
)


def build_parser() -> argparse.ArgumentParser:
    """The program's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "config", type=Path, help="experiment TOML file (top-level 'kind' picks the runner)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default: the TOML's 'out', else runs/experiments/<config stem>)",
    )
    parser.add_argument(
        "--figures",
        type=Path,
        help="also copy the plots here (default: the TOML's 'figures', if any)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs trained in parallel processes (default 1)"
    )
    parser.add_argument("--steps", type=int, help="override the number of steps per run")
    parser.add_argument("--seeds", help="override the seeds, comma-separated (e.g. 0,1,2)")
    parser.add_argument(
        "--rates", help="override the failure rates per stage-hour, comma-separated (e.g. 0.05,0.1)"
    )
    parser.add_argument("--target", help="override the target validation loss: a number or 'auto'")
    parser.add_argument(
        "--target-fraction",
        type=float,
        help="override target_fraction (the share of the steps at which the no-failure run's loss is the auto target)",
    )
    parser.add_argument(
        "--only",
        help="run only these strategies (names as in the tables, comma-separated, e.g. "
        "'checkfree,checkfree+,redundant'); the no-failure baseline always runs",
    )
    parser.add_argument("--force", action="store_true", help="re-run runs whose result file exists")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing; tabulate and plot the result files present",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    with open(args.config, "rb") as f:
        data = tomllib.load(f)
    kind = data.pop("kind", None)
    if kind not in RUNNERS:
        parser.error(f"{args.config}: top-level kind = {kind!r}; known kinds: {', '.join(RUNNERS)}")
    out = args.out or Path(data.pop("out", f"runs/experiments/{args.config.stem}"))
    data.pop("out", None)
    figures = args.figures or (Path(data.pop("figures")) if "figures" in data else None)
    data.pop("figures", None)
    try:
        return RUNNERS[kind](data, out, figures, args)
    except ValueError as err:
        parser.error(f"{args.config}: {err}")
    return 2


# ---- kind = "convergence" ------------------------------------------------------------------


def _run_cell(
    experiment: ConvergenceExperiment, key: RunKey, baseline: RunResult | None, path: Path
) -> str:
    """One run in a worker process; writes its result file (atomically)."""
    result = experiment.run(key, baseline=baseline)
    _write_json(path, result.to_dict())
    return str(path)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def run_convergence_kind(
    data: dict[str, Any], out: Path, figures: Path | None, args: argparse.Namespace
) -> int:
    """The CheckFree study: see `simulations.convergence.ConvergenceExperiment`."""
    if args.steps is not None:
        data["steps"] = args.steps
    if args.seeds is not None:
        data["seeds"] = [int(s) for s in args.seeds.split(",")]
    if args.rates is not None:
        data["rates"] = [float(r) for r in args.rates.split(",")]
    if args.target is not None:
        data["target"] = args.target if args.target == "auto" else float(args.target)
    if args.target_fraction is not None:
        data["target_fraction"] = args.target_fraction
    experiment = ConvergenceExperiment.from_dict(data)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(data, indent=2, default=str))

    def path_of(key: RunKey) -> Path:
        return runs_dir / key.file_name

    expected_setup = json.loads(
        json.dumps({"steps": experiment.steps, "eval_every": experiment.eval_every})
    )

    def load(key: RunKey) -> RunResult | None:
        path = path_of(key)
        if not path.exists():
            return None
        result = RunResult.from_dict(json.loads(path.read_text()))
        made = {
            "steps": result.steps,
            "eval_every": result.info.get("eval_every", experiment.eval_every),
        }
        setup = result.info.get("setup")
        if made != expected_setup or (
            setup is not None and setup["preset"] != experiment.setup.preset
        ):
            raise ValueError(
                f"{path} was made by a different experiment ({made}, preset "
                f"{setup and setup['preset']!r}); use another --out, or --force to re-run"
            )
        return result

    baselines = experiment.baselines()
    cells = experiment.runs()
    if args.only is not None and not args.report_only:
        wanted = {name.strip() for name in args.only.split(",")}
        unknown = wanted - {k.strategy.name for k in cells}
        if unknown:
            raise ValueError(f"--only names unknown strategies {sorted(unknown)}")
        cells = [k for k in cells if k.strategy.name in wanted]
    if not args.force:
        for key in [*baselines, *cells]:
            load(key)  # refuses result files of another experiment before running anything
    if not args.report_only:
        todo_base = [k for k in baselines if args.force or not path_of(k).exists()]
        _execute(experiment, todo_base, {}, path_of, args)
        base = {k.seed: load(k) for k in baselines}
        exact = [k for k in cells if k.strategy.exact and experiment.derive_exact]
        trained = [k for k in cells if k not in exact]
        todo = [k for k in trained if args.force or not path_of(k).exists()]
        todo += [k for k in exact if args.force or not path_of(k).exists()]
        _execute(experiment, todo, base, path_of, args)
    results = [r for r in (load(k) for k in [*baselines, *cells]) if r is not None]
    base_results = {r.seed: r for r in results if r.strategy == "none"}
    if not base_results:
        print("no results yet", file=sys.stderr)
        return 1
    targets = {
        seed: experiment.target
        if experiment.target is not None
        else auto_target(run, experiment.target_fraction)
        for seed, run in base_results.items()
    }
    rows = summarize(results, targets)
    _write_tables(out, rows, targets, experiment)
    paths = _plots(out, results, rows, targets, experiment)
    if experiment.sensitivity:
        sens = exact_sensitivity(experiment, base_results, targets)
        paths += _sensitivity(out, sens, rows, experiment)
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copy(p, figures / p.name)
    return 0


def _execute(
    experiment: ConvergenceExperiment,
    keys: list[RunKey],
    baselines: dict[int, RunResult | None],
    path_of: Callable[[RunKey], Path],
    args: argparse.Namespace,
) -> None:
    """Run ``keys`` (trained ones in ``--jobs`` processes), with a progress bar."""
    if not keys:
        return
    from tqdm import tqdm

    bar = tqdm(total=len(keys), desc="runs", unit="run", disable=args.quiet, dynamic_ncols=True)
    cheap = [
        k
        for k in keys
        if k.strategy.exact and k.strategy.kind != "none" and experiment.derive_exact
    ]
    heavy = [k for k in keys if k not in cheap]
    for key in cheap:
        _run_cell(experiment, key, baselines.get(key.seed), path_of(key))
        bar.update()
    if args.jobs == 1 or len(heavy) <= 1:
        for key in heavy:
            label = f"{key.strategy.name} {key.rate:g}/h seed {key.seed}"
            bar.set_postfix_str(label)

            def show(step: int, label: str = label) -> None:
                if step % 10 == 0:
                    bar.set_postfix_str(f"{label} step {step}")

            result = experiment.run(key, baseline=baselines.get(key.seed), progress=show)
            _write_json(path_of(key), result.to_dict())
            bar.update()
    else:
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
            futures = {
                pool.submit(_run_cell, experiment, key, baselines.get(key.seed), path_of(key)): key
                for key in heavy
            }
            for future in as_completed(futures):
                future.result()
                key = futures[future]
                bar.set_postfix_str(f"done {key.strategy.name} {key.rate:g}/h seed {key.seed}")
                bar.update()
    bar.close()


def _fmt_hours(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} h"


def _write_tables(
    out: Path,
    rows: list[dict[str, Any]],
    targets: dict[int, float],
    experiment: ConvergenceExperiment,
) -> None:
    columns = [
        "strategy", "rate", "seeds", "reached", "time_to_target_h", "vs_best_checkpoint",
        "vs_redundant", "final_val_loss", "total_time_h", "failures", "rollbacks", "lost_steps", "rebuilds", "steps_behind",
        "best_of",
    ]  # fmt: skip
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})
    (out / "results.json").write_text(
        json.dumps({"targets": targets, "rows": rows}, indent=2, default=str)
    )
    rates = sorted({row["rate"] for row in rows if row["strategy"] != "none"})
    names = sorted(
        {row["strategy"] for row in rows if row["strategy"] != "none"},
        key=lambda n: (display_rank(n), n),
    )
    cell = {(row["strategy"], row["rate"]): row for row in rows}
    target_text = ", ".join(f"seed {s}: {t:.3f}" for s, t in sorted(targets.items()))
    none_rows = [row for row in rows if row["strategy"] == "none"]
    lines = [
        f"Time to target validation loss ({target_text}); mean over the seeds that reach it. "
        "In brackets: best checkpointing's time / this time (> 1 = faster).",
        "",
        "| strategy | " + " | ".join(f"{r:.0%}/h" for r in rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    if none_rows:
        lines.append(
            "| none (no failures) | "
            + " | ".join(_fmt_hours(none_rows[0]["time_to_target_h"]) for _ in rates)
            + " |"
        )
    for name in names:
        cells = []
        for rate in rates:
            row = cell.get((name, rate))
            if row is None:
                cells.append("")
                continue
            text = _fmt_hours(row["time_to_target_h"])
            if row.get("best_of"):
                text += f" ({row['best_of']})"
            elif row["vs_best_checkpoint"] is not None:
                text += f" ({row['vs_best_checkpoint']:.2f}x)"
            if row["reached"] < row["seeds"]:
                text += f" [{row['reached']}/{row['seeds']} seeds]"
            cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Failures per run (mean): "
        + "; ".join(
            f"{r:.0%}/h: "
            + ", ".join(
                f"{n} {cell[(n, r)]['failures']:.1f}"
                for n in names
                if (n, r) in cell and not n.startswith("checkpoint (")
            )
            for r in rates
        ),
        "",
    ]
    lines += [
        "What the failures cost (means over seeds): final validation loss after all steps, and "
        "how many no-failure steps' worth of progress the run is behind at the end.",
        "",
        "| strategy | rate | failures | rebuilt | rollbacks (steps redone) | final val loss "
        "| steps behind | per rebuild |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["strategy"] == "checkpoint (best)" or row["strategy"].startswith("checkpoint-"):
            continue
        behind = row.get("steps_behind")
        rebuilt = row.get("rebuilds") or 0.0
        per = f"{behind / rebuilt:.1f}" if behind is not None and rebuilt else ""
        lines.append(
            f"| {row['strategy']} | {row['rate']:.0%} | {row['failures']:.1f} | {rebuilt:.1f} | "
            f"{row['rollbacks']:.1f} ({row['lost_steps']:.0f}) | {row['final_val_loss']:.4f} | "
            f"{'ahead' if behind is None else f'{behind:.0f}'} | {per} |"
        )
    lines.append("")
    text = "\n".join(lines)
    (out / "time_to_target.md").write_text(text)
    print(text)


def _plots(
    out: Path,
    results: list[RunResult],
    rows: list[dict[str, Any]],
    targets: dict[int, float],
    experiment: ConvergenceExperiment,
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    seed = min(targets)
    target = targets[seed]
    base = next(r for r in results if r.strategy == "none" and r.seed == seed)
    rates = sorted({r.rate for r in results if r.rate > 0})
    names = sorted(
        {r.strategy for r in results if r.strategy != "none"}, key=lambda n: (display_rank(n), n)
    )
    colors = {name: f"C{i % 10}" for i, name in enumerate(["none", *names])}
    early = [rec.val_loss for rec in base.records if rec.step >= 0.25 * base.steps]
    top = early[0] if early else base.records[0].val_loss
    low = min(rec.val_loss for r in results for rec in r.records)
    for rate in rates:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        free = [r for r in results if r.rate == 0 and r.strategy != "none" and r.seed == seed]
        runs = [base, *free, *[r for r in results if r.rate == rate and r.seed == seed]]
        for run in runs:
            xs = [rec.time_s / 3600 for rec in run.records]
            ys = [rec.val_loss for rec in run.records]
            free_variant = run.rate == 0 and run.strategy != "none"
            style = "--" if run.strategy.startswith("checkpoint") else ":" if free_variant else "-"
            label = "none (no failures)" if run.strategy == "none" else run.strategy
            if run.rate == 0 and run.strategy != "none":
                label += " (no failures)"
            ax.plot(xs, ys, style, lw=1.3, color=colors[run.strategy], label=label)
        ax.axhline(target, color="k", lw=0.8, ls=":", label=f"target {target:.3f}")
        ax.set_ylim(low - 0.02, top + 0.02)
        # Checkpointing with a long interval can take many times longer: keep the region
        # where the strategies compete readable.
        ax.set_xlim(0, 2.2 * base.total_time_s / 3600)
        ax.set_xlabel("simulated wall-clock time (h)")
        ax.set_ylabel("validation loss")
        ax.set_title(f"{rate:.0%} failures per stage-hour (seed {seed})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out / f"convergence_rate{round(rate * 100):02d}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    shown = [n for n in names if not n.startswith("checkpoint-")] + ["checkpoint (best)"]
    cell = {(row["strategy"], row["rate"]): row for row in rows}
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(shown) * len(rates) / 2), 4.5), dpi=110)
    width = 0.8 / len(shown)
    finite = [row["time_to_target_h"] for row in rows if row["time_to_target_h"] is not None]
    cap = 1.1 * max(finite) if finite else 1.0
    for i, name in enumerate(shown):
        xs, hs, hatch = [], [], []
        for j, rate in enumerate(rates):
            row = cell.get((name, rate))
            if row is None:
                continue
            xs.append(j + (i - (len(shown) - 1) / 2) * width)
            value = row["time_to_target_h"]
            hs.append(cap if value is None else value)
            hatch.append(value is None)
        bars = ax.bar(xs, hs, width, label=name, color=colors.get(name, "0.5"))
        for bar, missing in zip(bars, hatch, strict=True):
            if missing:
                bar.set_hatch("//")
                bar.set_alpha(0.4)
    none_time = cell.get(("none", 0.0), {}).get("time_to_target_h")
    if none_time is not None and math.isfinite(none_time):
        ax.axhline(none_time, color="k", lw=0.8, ls=":", label="no failures")
    ax.set_xticks(range(len(rates)), [f"{r:.0%}/h" for r in rates])
    ax.set_ylabel("time to target loss (h, mean over seeds)")
    ax.set_title("Time to target validation loss (hatched: not reached)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "time_to_target.png"
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
    return paths


def _sensitivity(
    out: Path,
    sens: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    experiment: ConvergenceExperiment,
) -> list[Path]:
    """Table and plot: best checkpointing's and redundant computation's time to target as a
    cost varies, against the CheckFree runs (whose times do not depend on that cost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "sensitivity.json").write_text(json.dumps(sens, indent=2))
    rates = sorted({r["rate"] for r in sens})
    fixed = {(r["strategy"], r["rate"]): r["time_to_target_h"] for r in rows}
    ours = [n for n in ("checkfree", "checkfree+") if any(k[0] == n for k in fixed)]

    def find(name: str, value: float, rate: float, strategy: str) -> dict[str, Any] | None:
        return next(
            (r for r in sens if r["field"] == name and r["value"] == value
             and r["rate"] == rate and r["strategy"] == strategy),
            None,
        )  # fmt: skip

    lines = []
    paths = []
    for name, values in experiment.sensitivity.items():
        lines += [
            f"Time to target (h) as `{name}` varies: best checkpointing (its interval) / redundant "
            "computation; in brackets each one's time divided by CheckFree+'s (> 1: CheckFree+ "
            "faster). CheckFree+: "
            + ", ".join(
                f"{r:.0%}/h {fixed[('checkfree+', r)]:.1f} h"
                for r in rates
                if fixed.get(("checkfree+", r)) is not None
            )
            + ".",
            "",
            f"| {name} | " + " | ".join(f"{r:.0%}/h" for r in rates) + " |",
            "|---|" + "---|" * len(rates),
        ]
        for value in values:
            cells = []
            for rate in rates:
                plus = fixed.get(("checkfree+", rate))
                parts = []
                for strategy in ("checkpoint (best)", "redundant"):
                    row = find(name, value, rate, strategy)
                    if row is None or row["time_to_target_h"] is None:
                        parts.append("n/r")
                        continue
                    t = row["time_to_target_h"]
                    text = f"{t:.1f}"
                    if row.get("best_of"):
                        text += f" ({row['best_of'].removeprefix('checkpoint-')})"
                    if plus:
                        text += f" [{t / plus:.2f}x]"
                    parts.append(text)
                cells.append(" / ".join(parts))
            lines.append(f"| {value:g} | " + " | ".join(cells) + " |")
        lines.append("")
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
        for i, rate in enumerate(rates):
            for strategy, marker in (("checkpoint (best)", "o-"), ("redundant", "s--")):
                xs, ys = [], []
                for value in values:
                    row = find(name, value, rate, strategy)
                    if row is not None and row["time_to_target_h"] is not None:
                        xs.append(value)
                        ys.append(row["time_to_target_h"])
                label = "best checkpointing" if strategy.startswith("checkpoint") else strategy
                ax.plot(xs, ys, marker, color=f"C{i}", ms=4, lw=1.2, label=f"{label}, {rate:.0%}/h")
            for style, strategy in zip(("-.", ":"), ours, strict=False):
                t = fixed.get((strategy, rate))
                if t is not None:
                    ax.axhline(t, color=f"C{i}", ls=style, lw=1, label=f"{strategy}, {rate:.0%}/h")
        ax.set_xlabel(f"{name} (s)" if name.endswith("_s") else name)
        ax.set_ylabel("time to target loss (h)")
        ax.set_title(f"Baselines' time to target as {name} varies")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=3)
        fig.tight_layout()
        path = out / f"sensitivity_{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    text = "\n".join(lines)
    (out / "sensitivity.md").write_text(text)
    print(text)
    return paths


# ---- kind = "runtime" / "simulator" (simulations/experiments.py) -------------------------


def run_runtime_kind(
    data: dict[str, Any], out: Path, figures: Path | None, args: argparse.Namespace
) -> int:
    from simulations.experiments import run_runtime_kind as run

    if args.steps:
        data["steps"] = args.steps
    if args.seeds:
        data["seeds"] = [int(s) for s in args.seeds.split(",")]
    if args.rates:
        data["rates"] = [float(r) for r in args.rates.split(",")]
    run(data, out, figures, force=args.force, report_only=args.report_only, progress=not args.quiet)
    return 0


def run_simulator_kind(
    data: dict[str, Any], out: Path, figures: Path | None, args: argparse.Namespace
) -> int:
    from simulations.experiments import run_simulator_kind as run

    if args.seeds:
        data["seeds"] = len(args.seeds.split(","))
    run(data, out, figures, progress=not args.quiet)
    return 0


RUNNERS: dict[str, Callable[[dict[str, Any], Path, Path | None, argparse.Namespace], int]] = {
    "convergence": run_convergence_kind,
    "runtime": run_runtime_kind,
    "simulator": run_simulator_kind,
}
"""``kind`` -> runner(toml data without kind/out/figures, out folder, figures folder, args)."""

if __name__ == "__main__":
    raise SystemExit(main())
