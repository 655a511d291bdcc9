"""Cluster-scale failure simulation from the command line: goodput per recovery strategy.

    checkfree simulate --gpus 16384 --days 54 --layout pp=16,dp=128,tp=8 --mtbf-hours 50000 --plot goodput.png
    checkfree simulate --gpus 1024 --days 5 --strategies checkpoint_restart,checkfree+ --seeds 10
    checkfree simulate --gpus 512 --days 3 --weibull-shape 0.7 --mtbf-hours 5000 --json out.json
    checkfree simulate --gpus 102400 --straggler-factor 2 --straggler-hours inf
    checkfree simulate --straggler-rate 0        # failures only: no straggler table

Prints a goodput table with confidence intervals per strategy and the share of wall time
lost per cause; see ``[Note: simulator model]`` in ``simulations/cluster.py`` for what the
model does and does not capture. Then, unless ``--straggler-rate 0``, a second table: the
same failures with slow workers added, each strategy's goodput with the stragglers left
slow and with them replaced once detected (``[Note: straggler model]`` in
``simulations/stragglers.py``; the straggler defaults are assumptions, not measurements).
The first table never includes stragglers, so it is the same with or without them. In a
checkout, ``python scripts/simulate.py`` is the same program.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from tqdm import tqdm

from recovery.cli.help import HelpFormatter
from simulations.cluster import (
    CAUSES,
    POLICY_MODELS,
    CheckpointRestart,
    Job,
    Layout,
    PolicyModel,
    Scenario,
    SimulationResult,
    SnapshotPolicy,
    make_policy_model,
    sweep,
)
from simulations.costs import CostModel, check_renamed
from simulations.results import straggler_table
from simulations.stragglers import (
    STRAGGLER_FACTOR,
    STRAGGLER_MEAN_HOURS,
    STRAGGLER_PATIENCE_STEPS,
    STRAGGLER_RATE_PER_GPU_HOUR,
    StragglerModel,
)
from simulations.traces import (
    COMPONENTS,
    LLAMA3_GPU_MTBF_HOURS,
    ExponentialFailures,
    FailureModel,
    MixedFailures,
    TraceReplay,
    WeibullFailures,
    llama3_failures,
)


def _optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    job = p.add_argument_group("job")
    job.add_argument(
        "--gpus", type=int, default=16_384, help="GPUs in the job (default: 16384, Llama 3's)"
    )
    job.add_argument(
        "--layout",
        help="pp=<stages>,dp=<replicas>[,tp=<gpus per worker>]; must multiply to --gpus (default: tp=8 and up to 16 stages)",
    )
    job.add_argument(
        "--days",
        type=float,
        default=54.0,
        help="simulated wall time in days (default: 54, Llama 3's run)",
    )
    job.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs a node failure takes down together (default: 8)",
    )
    job.add_argument(
        "--nodes-per-rack",
        type=int,
        default=2,
        help="nodes a rack failure takes down together (default: 2)",
    )
    fail = p.add_argument_group(
        "failures (default: Llama 3's rate, GPU failures plus whole-node failures)"
    )
    fail.add_argument(
        "--failures",
        choices=("llama3", "llama3-gpu"),
        default="llama3",
        help="preset: llama3 = 47.3%% single-GPU, rest whole-node; llama3-gpu = all single-GPU (default: llama3)",
    )
    fail.add_argument(
        "--mtbf-hours",
        type=float,
        help="per-GPU MTBF in hours: independent GPU failures at this rate replace the preset (Llama 3: ~50,676)",
    )
    fail.add_argument(
        "--weibull-shape",
        type=float,
        help="Weibull lifetimes of this shape for the GPU failures (<1 infant mortality, >1 wear-out); MTBF from --mtbf-hours or Llama 3's",
    )
    fail.add_argument(
        "--age-hours",
        type=float,
        default=0.0,
        help="age of every GPU at the start, for --weibull-shape (default: 0)",
    )
    fail.add_argument(
        "--node-mtbf-hours",
        type=float,
        help="add whole-node failures with this per-node MTBF in hours",
    )
    fail.add_argument(
        "--rack-mtbf-hours",
        type=float,
        help="add whole-rack failures with this per-rack MTBF in hours",
    )
    fail.add_argument(
        "--trace",
        type=Path,
        help="replay a CSV trace (header 'time_s,component'; component gpu:<id>, node:<id>, rack:<id>) instead of a model",
    )
    fail.add_argument(
        "--trace-no-offset",
        action="store_true",
        help="replay the trace from its start in every seed (default: each seed at a random phase)",
    )
    strat = p.add_argument_group("strategies and costs")
    strat.add_argument(
        "--strategies",
        default="all",
        help=f"'all' or a comma list of: {', '.join(POLICY_MODELS)} (default: all)",
    )
    strat.add_argument(
        "--calibration",
        type=Path,
        help="JSON cost model written by scripts/bench.py (fields absent keep their defaults)",
    )
    strat.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override one cost model field, e.g. --set restart_s=600 (repeatable; applied after --calibration)",
    )
    strat.add_argument(
        "--checkpoint-interval-s",
        type=float,
        help="checkpoint_restart: work seconds between checkpoints (default: from --checkpoint-formula)",
    )
    strat.add_argument(
        "--checkpoint-formula",
        choices=("daly", "young"),
        default="daly",
        help="checkpoint_restart: optimal interval formula (default: daly)",
    )
    strat.add_argument(
        "--snapshot-every-steps",
        type=_optional(int),
        default=50,
        help="peer strategies: steps between in-memory snapshots, or 'none' (default: 50)",
    )
    strat.add_argument(
        "--durable-every-hours",
        type=_optional(float),
        default=3.0,
        help="peer strategies: work hours between durable checkpoints, or 'none' (default: 3)",
    )
    strat.add_argument(
        "--cold-spares",
        action="store_true",
        help="peer strategies replace dead workers cold (replace_s) rather than from warm spares",
    )
    slow = p.add_argument_group(
        "stragglers (defaults are assumptions: no per-GPU straggler rate is published; see "
        "[Note: straggler model] in simulations/stragglers.py)"
    )
    slow.add_argument(
        "--straggler-rate",
        type=float,
        default=STRAGGLER_RATE_PER_GPU_HOUR,
        help="slow-worker onsets per GPU-hour; 0: no stragglers and no straggler table "
        f"(default: {STRAGGLER_RATE_PER_GPU_HOUR:.3g}, Llama 3's per-GPU interruption rate "
        "reused: an assumption)",
    )
    slow.add_argument(
        "--straggler-factor",
        type=float,
        default=STRAGGLER_FACTOR,
        help="how many times slower a straggler's steps are; the whole job runs at its pace "
        f"(default: {STRAGGLER_FACTOR:g}, the issue's 3x case: an assumption)",
    )
    slow.add_argument(
        "--straggler-hours",
        type=float,
        default=STRAGGLER_MEAN_HOURS,
        help="mean of the exponential duration of a slow episode, or 'inf': slow until "
        f"replaced (default: {STRAGGLER_MEAN_HOURS:g}, an assumption inside Falcon's "
        "published tens of seconds to ~10 hours, arXiv 2410.12588)",
    )
    slow.add_argument(
        "--straggler-patience",
        type=int,
        default=STRAGGLER_PATIENCE_STEPS,
        help="mitigation: steps at the slow pace before the worker is replaced like a "
        f"failed one (default: {STRAGGLER_PATIENCE_STEPS}, an assumption)",
    )
    run = p.add_argument_group("run and output")
    run.add_argument("--seeds", type=int, default=100, help="Monte Carlo seeds (default: 100)")
    run.add_argument("--seed", type=int, default=0, help="base random seed (default: 0)")
    run.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="confidence level of the intervals (default: 0.95)",
    )
    run.add_argument(
        "--plot", type=Path, help="write a bar plot of goodput and lost time per cause to this PNG"
    )
    run.add_argument(
        "--json", type=Path, help="write the summary (means, intervals, lost time, actions) as JSON"
    )
    run.add_argument(
        "--events",
        type=Path,
        help="write every failure event and each strategy's action to this CSV",
    )
    run.add_argument(
        "--ray",
        action="store_true",
        help="run the seeds as Ray tasks (cluster in RAY_ADDRESS, else a local Ray)",
    )
    run.add_argument(
        "--chunks",
        type=int,
        default=4,
        help="seed chunks (Ray tasks, or progress steps locally) (default: 4)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def failure_model(args: argparse.Namespace) -> FailureModel:
    """The failure model the flags describe.

    Raises:
        ValueError: for contradictory flags or a bad trace file.
    """
    if args.trace is not None:
        if args.mtbf_hours is not None or args.weibull_shape is not None:
            raise ValueError(
                "--trace replaces the failure model; drop --mtbf-hours/--weibull-shape"
            )
        return TraceReplay.from_csv(args.trace, random_offset=not args.trace_no_offset)
    parts: list[FailureModel] = []
    if args.weibull_shape is not None:
        mtbf = args.mtbf_hours if args.mtbf_hours is not None else LLAMA3_GPU_MTBF_HOURS
        parts.append(
            WeibullFailures(shape=args.weibull_shape, mtbf_hours=mtbf, age_hours=args.age_hours)
        )
    elif args.mtbf_hours is not None:
        parts.append(ExponentialFailures(mtbf_hours=args.mtbf_hours))
    else:
        parts.append(
            llama3_failures(correlated=args.failures == "llama3", gpus_per_node=args.gpus_per_node)
        )
    if args.node_mtbf_hours is not None:
        parts.append(ExponentialFailures(mtbf_hours=args.node_mtbf_hours, component="node"))
    if args.rack_mtbf_hours is not None:
        parts.append(ExponentialFailures(mtbf_hours=args.rack_mtbf_hours, component="rack"))
    return parts[0] if len(parts) == 1 else MixedFailures(tuple(parts))


def cost_model(args: argparse.Namespace) -> CostModel:
    """The cost model: defaults, then --calibration, then each --set.

    Raises:
        ValueError: for a bad calibration file or a bad --set.
    """
    fields = (
        CostModel().to_dict()
        if args.calibration is None
        else CostModel.from_json(args.calibration).to_dict()
    )
    for item in args.set:
        name, sep, value = item.partition("=")
        check_renamed([name.strip()], f"--set {item!r}", CostModel.renamed)
        if not sep or name.strip() not in fields:
            raise ValueError(
                f"bad --set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}"
            )
        try:
            fields[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"bad --set {item!r}: {value!r} is not a number") from None
    return CostModel.from_dict(fields)


def strategies(args: argparse.Namespace) -> tuple[PolicyModel, ...]:
    """The strategies the flags name, configured.

    Raises:
        ValueError: for an unknown strategy name or a bad option.
    """
    names = (
        list(POLICY_MODELS)
        if args.strategies.strip() == "all"
        else [s.strip() for s in args.strategies.split(",") if s.strip()]
    )
    durable = None if args.durable_every_hours is None else args.durable_every_hours * 3600.0
    policy = SnapshotPolicy(every_steps=args.snapshot_every_steps, durable_every_s=durable)
    out: list[PolicyModel] = []
    for name in names:
        if name == CheckpointRestart.name:
            out.append(
                CheckpointRestart(
                    interval_s=args.checkpoint_interval_s, formula=args.checkpoint_formula
                )
            )
        else:
            out.append(make_policy_model(name, snapshots=policy, warm_spares=not args.cold_spares))
    return tuple(out)


def straggler_model(args: argparse.Namespace) -> StragglerModel | None:
    """The straggler model the flags describe, or ``None`` for a zero rate.

    Raises:
        ValueError: for a bad rate, factor, duration or patience.
    """
    model = StragglerModel(
        rate_per_gpu_hour=args.straggler_rate,
        factor=args.straggler_factor,
        mean_hours=args.straggler_hours,
        patience_steps=args.straggler_patience,
    )
    return model if model.active else None


def write_events(path: Path, result: SimulationResult) -> None:
    """Every event of every seed, one row per (event, strategy)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "strategy",
                "seed",
                "time_s",
                "component",
                "first_gpu",
                "num_gpus",
                "action",
                "downtime_s",
                "progress_lost_s",
            ]
        )
        for r in result.strategies:
            log = r.events
            if log is None:
                continue
            for k in range(len(log)):
                w.writerow(
                    [
                        r.name,
                        int(log.seed[k]) + result.first_seed,
                        f"{log.time_s[k]:.3f}",
                        COMPONENTS[int(log.component[k])],
                        int(log.first_gpu[k]),
                        int(log.num_gpus[k]),
                        log.action_names[int(log.action[k])],
                        f"{log.downtime_s[k]:.3f}",
                        f"{log.progress_lost_s[k]:.3f}",
                    ]
                )


def plot(path: Path, result: SimulationResult, level: float) -> None:
    """Goodput with confidence intervals, and lost time per cause, one bar per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in result.strategies]
    stats = [r.goodput_ci(level) for r in result.strategies]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.5 * len(names) + 2.5), sharey=True)
    y = range(len(names))
    means = [m for m, _, _ in stats]
    err = [
        [m - lo if math.isfinite(lo) else 0 for m, lo, _ in stats],
        [hi - m if math.isfinite(hi) else 0 for m, _, hi in stats],
    ]
    ax1.barh(y, means, xerr=err, color="tab:green", capsize=3)
    ax1.set_yticks(list(y), names)
    ax1.invert_yaxis()
    ax1.set_xlim(min(means) - 0.05 if min(means) > 0.05 else 0, 1)
    ax1.set_xlabel(f"goodput (useful / wall time), {level:.0%} CI")
    for k, m in enumerate(means):
        ax1.text(m, k, f" {m:.4f}", va="center", fontsize=8)
    left = [0.0] * len(names)
    colors = plt.get_cmap("tab10")
    for c, cause in enumerate(CAUSES):
        vals = [100 * r.lost_fraction()[cause] for r in result.strategies]
        ax2.barh(y, vals, left=left, label=cause, color=colors(c))
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax2.set_xlabel("wall time lost, %")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"{result.job}, {result.horizon_s / 86400:g} days, {result.num_seeds} seeds\n{result.failures}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        layout = Layout.parse(args.layout) if args.layout else Layout.default_for(args.gpus)
        job = Job(
            gpus=args.gpus,
            layout=layout,
            gpus_per_node=args.gpus_per_node,
            nodes_per_rack=args.nodes_per_rack,
        )
        if not args.days > 0:
            raise ValueError(f"--days must be > 0, got {args.days}")
        if args.seeds < 1 or args.chunks < 1:
            raise ValueError("--seeds and --chunks must be >= 1")
        scenario = Scenario(
            job=job,
            failures=failure_model(args),
            horizon_s=args.days * 86400.0,
            strategies=strategies(args),
            costs=cost_model(args),
            seeds=args.seeds,
            seed=args.seed,
            keep_events=args.events is not None,
        )
        slow = straggler_model(args)
        variants = [scenario]
        if slow is not None:
            variants += [
                replace(scenario, stragglers=slow, keep_events=False, mitigate_stragglers=m)
                for m in (False, True)
            ]
        parts = [part for v in variants for part in v.split(args.chunks)]
        if args.ray:
            results = sweep(parts, use_ray=True, timeout=timedelta(hours=2))
        else:
            results = [
                s.run() for s in tqdm(parts, desc="simulating", unit="chunk", disable=args.quiet)
            ]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = len(results) // len(variants)
    merged = [SimulationResult.merge(results[k * n : (k + 1) * n]) for k in range(len(variants))]
    result = merged[0]
    print(result.table(args.confidence))
    summary = result.to_dict(args.confidence)
    if slow is not None:
        print()
        print(straggler_table(merged[0], merged[1], merged[2], slow.describe(), args.confidence))
        summary["stragglers"] = {
            "model": asdict(slow),
            "describe": slow.describe(),
            "unmitigated": merged[1].to_dict(args.confidence)["strategies"],
            "mitigated": merged[2].to_dict(args.confidence)["strategies"],
        }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.events:
        write_events(args.events, result)
        print(f"wrote {args.events}")
    if args.plot:
        plot(args.plot, result, args.confidence)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
