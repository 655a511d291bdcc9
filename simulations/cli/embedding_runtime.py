"""Embedding-table recovery on the real Ray runtime: measured time, held-out AUC and log loss.

    checkfree embedding-runtime            # small DLRM, 4 workers, 1500 steps, 6 kills (~10 min)
    checkfree embedding-runtime --preset tiny --steps 60 --failures 2 --heldout 2000

The same model (`dlrm_spec`), data and failure schedule (real worker processes killed
with SIGKILL) under each recovery policy: no failures; full rollback to a peer snapshot
taken every Young-interval steps (the interval from this machine's measured snapshot cost
and failure rate); CPR -- a lost shard restored from its neighbour's full copy, refreshed
every ``--mirror-every`` steps, survivors keep training; CPR with the ``--hot-rows`` most
used rows mirrored every step; and exact mirrors (every row every step). Reports the
final held-out AUC and log loss (the full tables assembled from the workers' shards),
wall-clock time and the time lost against the run without failures, what the recoveries
restored, and the mirrors' memory and traffic. Unlike ``checkfree embedding-experiment``,
whose times come from a cluster-scale time model, every second here is measured on this
machine (each dead worker is replaced by a warm spare). The wall-clock difference is
exposed to a shared host slowing down for part of a run, so the table also gives the lost
time from medians: the recoveries' own seconds, the redone steps at the failure-free
median step, and the difference of median step times over the run (the mirrors' cost).
Writes ``results.json`` to ``--out`` and the table to ``--table``. In a checkout, ``python
scripts/embedding_runtime.py`` is the same program.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from parallelism import Topology
from parallelism.workloads.clicks import ClickLogs
from parallelism.workloads.dlrm import (
    DenseDLRM,
    ShardLayout,
    assemble_tables,
    dlrm_spec,
    log_loss,
    predict_unsharded,
    roc_auc,
)
from recovery import FitResult, MirrorPolicy, RecoveryPolicy, SnapshotPolicy, Trainer, TrainSpec
from recovery.cli.help import HelpFormatter
from recovery.faults import FailureSchedule
from recovery.names import Strategy
from simulations.cli.embedding_experiment import add_job_flags
from simulations.embedding import failure_schedule

NEVER = 10**9


@dataclass
class Row:
    name: str
    auc: float
    log_loss: float
    wall_s: float
    lost_s: float
    step_ms: float
    lost_parts_s: float
    partial: int
    exact: int
    rollbacks: int
    redone_steps: int
    rows_stale: int
    pls: float
    mirror_mb: float
    traffic_kb_per_step: float


def evaluate(spec: TrainSpec, result: FitResult, workers: int, heldout: int) -> tuple[float, float]:
    """Held-out (AUC, log loss) of the final model, tables assembled from the shards."""
    assert spec.tables is not None and isinstance(spec.batches, ClickLogs)
    config = spec.tables.config
    layout = ShardLayout(config.table_rows, workers)
    tables = assemble_tables(layout, [result.state(0, r)["shard.weight"] for r in range(workers)])
    dense = DenseDLRM(config)
    state = result.state(0, 0)
    dense.load_state_dict(
        {k.removeprefix("dense."): v for k, v in state.items() if k.startswith("dense.")}
    )
    batch = spec.batches.heldout(heldout)
    logits = predict_unsharded(dense, tables, batch)
    return roc_auc(logits, batch.labels), log_loss(logits, batch.labels)


def median_step_s(result: FitResult) -> float:
    return statistics.median(float(m["step_s"]) for m in result.metrics)


def summarize(
    name: str, result: FitResult, base: FitResult, spec: TrainSpec, args: argparse.Namespace
) -> Row:
    auc, loss = evaluate(spec, result, args.workers, args.heldout)
    events = result.events
    by = lambda s: sum(1 for e in events if e.strategy == s)  # noqa: E731
    step, base_step = median_step_s(result), median_step_s(base)
    redone = sum(e.lost_steps for e in events)
    # Lost time from medians, robust to a host that slows down for part of a run: the
    # recoveries, the redone steps, and the per-step cost of the mirrors.
    parts = sum(e.seconds for e in events) + redone * base_step + (step - base_step) * args.steps
    return Row(
        name=name,
        auc=auc,
        log_loss=loss,
        wall_s=result.wall_s,
        lost_s=result.wall_s - base.wall_s,
        step_ms=step * 1e3,
        lost_parts_s=parts,
        partial=by(Strategy.EMBEDDING_PARTIAL),
        exact=by(Strategy.SHARD_MIRROR),
        rollbacks=by(Strategy.ROLLBACK),
        redone_steps=redone,
        rows_stale=int(sum(e.embedding["rows_stale"] for e in events if e.embedding)),
        pls=max((e.embedding["pls_job"] for e in events if e.embedding), default=0.0),
        mirror_mb=result.mirrors.get("mirror_memory_bytes", 0.0) / 1e6,
        traffic_kb_per_step=result.mirrors.get("update_bytes_per_step", 0.0) / 1e3,
    )


def table(rows: Sequence[Row]) -> str:
    reference = rows[0]
    lines = [
        "| strategy | held-out AUC | dAUC vs no failures | log loss | wall s | lost s (wall) | "
        "median step ms | lost s (recoveries + redone + mirror cost) | "
        "recoveries (partial / exact / rollback) | redone steps | stale rows | PLS | "
        "mirror MB/worker | mirror kB/step/worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.auc:.4f} | {r.auc - reference.auc:+.4f} | {r.log_loss:.4f} | "
            f"{r.wall_s:.1f} | {r.lost_s:+.1f} | {r.step_ms:.1f} | {r.lost_parts_s:+.1f} | "
            f"{r.partial} / {r.exact} / {r.rollbacks} | "
            f"{r.redone_steps} | {r.rows_stale} | {r.pls:.2e} | {r.mirror_mb:.2f} | "
            f"{r.traffic_kb_per_step:.1f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The program's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add_job_flags(parser)
    add("--mirror-every", type=int, default=100, help="steps between full mirror copies")
    add("--pls-budget", type=float, default=0.05, help="partial recovery's PLS budget")
    add("--heldout", type=int, default=20_000, help="held-out samples (default 20000)")
    add(
        "--out",
        type=Path,
        default=Path("runs/experiments/embedding-runtime"),
        help="results folder",
    )
    add(
        "--table",
        type=Path,
        default=Path("docs/figures/embedding_runtime.md"),
        help="where the table goes",
    )
    add("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        spec = dlrm_spec(preset=args.preset, batch_size=args.batch_size, seed=args.seed)
        topology = Topology(1, args.workers)
        spec.check(topology)
        failures = failure_schedule(
            steps=args.steps, workers=args.workers, failures=args.failures, seed=args.failure_seed
        )
        RecoveryPolicy(
            mirrors=MirrorPolicy(
                hot_rows=args.hot_rows, every=args.mirror_every, pls_budget=args.pls_budget
            )
        )
    except ValueError as err:
        parser.error(str(err))
    print(f"failures: {failures}", flush=True)

    def fit(name: str, policy: RecoveryPolicy, faults: FailureSchedule) -> FitResult:
        print(f"-- {name}", flush=True)
        # A warm spare replaces each dead worker, so that the runs differ by the recovery
        # strategy alone, not by Python and torch starting up in a fresh process.
        policy = dataclasses.replace(policy, hot_spares=1)
        return Trainer(
            spec, topology=topology, policy=policy, failures=faults, progress=not args.quiet
        ).fit(args.steps)

    quiet = MirrorPolicy(hot_rows=0, every=NEVER)  # the per-step row counts only
    base = fit(
        "no failures",
        RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=50), mirrors=quiet),
        FailureSchedule(),
    )
    step_s = base.wall_s / args.steps
    snapshot_s = sum(base.timings.get("snapshot_write", [0.0])) / max(
        1, len(base.timings.get("snapshot_write", []))
    )
    mtbf_s = base.wall_s / max(1, args.failures)
    young = max(1, round(math.sqrt(2 * max(snapshot_s, 1e-4) * mtbf_s) / step_s))
    print(
        f"measured: {step_s * 1e3:.1f} ms/step, peer snapshot {snapshot_s * 1e3:.1f} ms, "
        f"Young interval {young} steps",
        flush=True,
    )
    snapshots = SnapshotPolicy(peer_every=young)
    runs = [
        ("no failures", base),
        (f"full rollback (snapshot every {young})", fit("full rollback", RecoveryPolicy(
            allowed=(Strategy.ROLLBACK,), snapshots=snapshots, mirrors=quiet), failures)),
        (f"CPR (full copy every {args.mirror_every})", fit("CPR", RecoveryPolicy(
            snapshots=snapshots, mirrors=MirrorPolicy(
                hot_rows=0, every=args.mirror_every, pls_budget=args.pls_budget)), failures)),
        (f"CPR + {args.hot_rows} MFU rows/step", fit("CPR + MFU", RecoveryPolicy(
            snapshots=snapshots, mirrors=MirrorPolicy(
                hot_rows=args.hot_rows, every=args.mirror_every, pls_budget=args.pls_budget)),
            failures)),
        ("exact mirrors (every row every step)", fit("exact", RecoveryPolicy(
            snapshots=snapshots, mirrors=MirrorPolicy(every=1, embedding="exact")), failures)),
    ]  # fmt: skip
    rows = [summarize(name, r, base, spec, args) for name, r in runs]
    text = table(rows)
    title = (
        f"DLRM '{args.preset}' on the Ray runtime, {args.workers} workers x {args.batch_size} "
        f"samples, {args.steps} steps, {args.failures} workers killed ({failures}); measured "
        f"{step_s * 1e3:.1f} ms/step, Young interval {young} steps"
    )
    print(f"\n{title}\n\n{text}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {"config": {k: str(v) for k, v in vars(args).items()}, "title": title,
             "rows": [r.__dict__ for r in rows]}, indent=1)
    )  # fmt: skip
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(f"{title}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
