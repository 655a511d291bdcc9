"""Embedding-table recovery under failures: full rollback vs CPR vs CPR with MFU shard mirrors.

    checkfree embedding-experiment                    # the default study (a few minutes)
    checkfree embedding-experiment --preset tiny --steps 60 --heldout 2000   # a smoke run
    checkfree embedding-experiment --report-only      # re-tabulate and re-plot the last run

Trains the same row-sharded DLRM (`parallelism.dlrm`) on the same synthetic click logs
with a planted truth (`parallelism.clicks`), under the same failure schedule, once per
strategy (`simulations.embedding`, see its [Note: embedding simulator model]), and
reports final held-out AUC and log loss, modelled total and lost time, what the
recoveries restored and the mirrors cost. Writes ``results.json`` and ``table.md`` to
``--out`` and the plot to ``--figure``. In a checkout, ``python
scripts/embedding_experiment.py`` is the same program.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from recovery.cli.help import HelpFormatter
from recovery.faults import FailureSchedule
from simulations.embedding import (
    EmbeddingRunResult,
    EmbeddingSetup,
    EmbeddingStrategy,
    EmbeddingTimeModel,
    default_strategies,
    failure_schedule,
    plot_results,
    results_table,
    run_embedding,
)


class _Renamed(argparse.Action):
    """A flag renamed so that every simulator spells a cost one way: refused, naming the new one."""

    def __init__(
        self, option_strings: list[str], dest: str, *, renamed: str, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, nargs="?", **kwargs)
        self.renamed = renamed

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string} is now {self.renamed}")


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the embedding study's job, shared with ``embedding-runtime``: the DLRM
    preset, workers, batch, steps, seeds, failures and the hot rows mirrored."""
    add = parser.add_argument
    add("--preset", default="small", help="DLRM preset: tiny or small (default small)")
    add("--workers", type=int, default=4, help="workers = shards = dense replicas (default 4)")
    add("--batch-size", type=int, default=256, help="samples per worker per step (default 256)")
    add("--steps", type=int, default=1500, help="committed steps per run (default 1500)")
    add("--seed", type=int, default=0, help="seeds weights, data and planted truth (default 0)")
    add("--failures", type=int, default=6, help="worker deaths per run (default 6)")
    add("--failure-seed", type=int, default=0, help="seeds the failure schedule (default 0)")
    add("--hot-rows", type=int, default=4096, help="MFU rows mirrored every step, per shard")


def build_parser() -> argparse.ArgumentParser:
    """The program's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add_job_flags(parser)
    add("--mirror-every", type=int, default=100, help="steps between full mirror syncs")
    add("--pls-budget", type=float, default=0.05, help="partial recovery's PLS budget")
    add(
        "--partial-checkpoint-every",
        type=int,
        help="checkpoint interval (steps) of the partial strategies (default: Young/Daly's)",
    )
    # The time model's flags are its fields, one to one, with its defaults.
    time = EmbeddingTimeModel()
    for name, what in (
        ("step_s", "seconds per step"),
        ("checkpoint_write_s", "seconds to write a checkpoint"),
        ("checkpoint_load_s", "seconds to load the checkpoint into every worker"),
        ("detect_s", "seconds to detect a failure"),
        ("replace_s", "seconds to start a replacement"),
        ("transfer_bytes_per_s", "worker-to-worker bytes/s (1.25e9 = 10 Gb/s)"),
    ):
        default = getattr(time, name)
        flag = "--" + name.replace("_", "-")
        add(flag, type=float, default=default, help=f"modelled {what} (default {default:g})")
    add(
        "--checkpoint-formula",
        choices=("daly", "young"),
        default=time.checkpoint_formula,
        help=f"optimal checkpoint interval rule (default {time.checkpoint_formula})",
    )
    for old, renamed in (
        ("--bandwidth", "--transfer-bytes-per-s"),
        ("--interval", "--checkpoint-formula"),
    ):
        add(
            old, action=_Renamed, renamed=renamed, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    add("--eval-every", type=int, default=100, help="evaluate every this many steps")
    add("--heldout", type=int, default=20_000, help="held-out samples (default 20000)")
    add("--only", help="comma-separated strategy names to run (the no-failure run always runs)")
    add("--out", type=Path, default=Path("runs/experiments/embedding"), help="results folder")
    add(
        "--figure",
        type=Path,
        default=Path("docs/figures/embedding_recovery.png"),
        help="where the plot goes",
    )
    add("--quiet", action="store_true", help="no progress bar")
    add(
        "--report-only",
        action="store_true",
        help="run nothing: re-tabulate and re-plot <out>/results.json",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        setup = EmbeddingSetup(
            preset=args.preset,
            workers=args.workers,
            batch_size=args.batch_size,
            steps=args.steps,
            seed=args.seed,
            heldout=args.heldout,
            eval_every=args.eval_every,
        )
        times = EmbeddingTimeModel(
            step_s=args.step_s,
            checkpoint_write_s=args.checkpoint_write_s,
            checkpoint_load_s=args.checkpoint_load_s,
            detect_s=args.detect_s,
            replace_s=args.replace_s,
            transfer_bytes_per_s=args.transfer_bytes_per_s,
            checkpoint_formula=args.checkpoint_formula,
        )
        strategies = default_strategies(
            hot_rows=args.hot_rows,
            mirror_every=args.mirror_every,
            pls_budget=args.pls_budget,
            partial_checkpoint_every=args.partial_checkpoint_every,
        )
        failures = failure_schedule(
            steps=args.steps, workers=args.workers, failures=args.failures, seed=args.failure_seed
        )
    except ValueError as err:
        parser.error(str(err))
    if args.report_only:
        try:
            saved = json.loads((args.out / "results.json").read_text())
            results = [EmbeddingRunResult.from_dict(r) for r in saved["results"]]
        except (OSError, ValueError, KeyError) as err:
            parser.error(f"cannot read {args.out / 'results.json'}: {err}")
        title = saved["config"].get("title", "")
    else:
        if args.only:
            wanted = {name.strip() for name in args.only.split(",")}
            unknown = wanted - {s.name for s in strategies}
            if unknown:
                parser.error(
                    f"unknown strategies {sorted(unknown)}; known: {[s.name for s in strategies]}"
                )
            strategies = [s for s in strategies if s.recovery == "none" or s.name in wanted]
        print(f"failures: {failures}", flush=True)
        results = [_run(setup, s, failures, times, quiet=args.quiet) for s in strategies]
        title = (
            f"DLRM '{args.preset}', {args.workers} workers, {args.failures} failures in "
            f"{args.steps} steps"
        )
        if args.partial_checkpoint_every:
            title += f"; partial strategies checkpoint every {args.partial_checkpoint_every} steps"
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        config |= {"failures_schedule": str(failures), "title": title}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps({"config": config, "results": [r.to_dict() for r in results]}, indent=1)
        )
    table = results_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    args.figure.with_suffix(".md").write_text(f"{title}\n\n{table}\n")
    plot_results(results, str(args.figure), title=title)
    print(table)
    for r in results:
        for e in r.events:
            print(
                f"  {r.strategy:>18}: step {e.step:5d} lost {e.lost} -> {e.decision:8s} "
                f"exact/stale {e.rows_exact}/{e.rows_stale} PLS event {e.pls_event:.4f} "
                f"job {e.pls_job:.4f} downtime {e.downtime_s:.1f}s redo {e.redo_steps}"
            )
    print(f"wrote {args.out / 'table.md'}, {args.figure} and {args.figure.with_suffix('.md')}")
    return 0


def _run(
    setup: EmbeddingSetup,
    strategy: EmbeddingStrategy,
    failures: FailureSchedule,
    times: EmbeddingTimeModel,
    *,
    quiet: bool,
) -> EmbeddingRunResult:
    """One strategy's run, with a progress bar over committed steps."""
    with tqdm(total=setup.steps, desc=f"{strategy.name:>18}", disable=quiet) as bar:
        seen = 0

        def advance(committed: int) -> None:
            nonlocal seen
            bar.update(max(0, committed - seen))
            seen = max(seen, committed)

        return run_embedding(setup, strategy, failures, times, progress=advance)


if __name__ == "__main__":
    raise SystemExit(main())
