"""How fast the cluster simulator is, and what it says at 1k, 16k and 100k GPUs.

    checkfree bench-simulator            # timings against the budgets, then goodput tables
    checkfree bench-simulator --check    # exit 1 if a timing misses its budget
    checkfree bench-simulator --seeds 20 --repeats 1 --json simulator.json

Timings: 100 seeds of a 54-day job under the Llama 3 failure rate (GPU plus node
failures), every strategy, at 16,384 GPUs (budget 10 s) and 100,000 GPUs (budget 60 s),
including drawing the failures; the best of ``--repeats`` runs. In a checkout, ``python
scripts/bench_simulator.py`` is the same program.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from recovery.cli.help import HelpFormatter
from simulations.cluster import Job, Layout, SimulationResult, simulate
from simulations.costs import CostModel
from simulations.traces import llama3_failures

SIZES: tuple[tuple[int, str], ...] = (
    (1_024, "pp=8,dp=16,tp=8"),
    (16_384, "pp=16,dp=128,tp=8"),
    (100_000, "pp=20,dp=625,tp=8"),
)
BUDGETS_S = {16_384: 10.0, 100_000: 60.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--seeds", type=int, default=100, help="Monte Carlo seeds per run (default: 100)"
    )
    p.add_argument(
        "--days", type=float, default=54.0, help="simulated wall time in days (default: 54)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per size; the best is reported (default: 3)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        help="JSON cost model from scripts/bench.py (default: CostModel defaults)",
    )
    p.add_argument("--json", type=Path, help="also write timings and goodput tables as JSON here")
    p.add_argument(
        "--check", action="store_true", help="exit with status 1 if a timing misses its budget"
    )
    return p


def run(
    gpus: int, layout: str, args: argparse.Namespace, costs: CostModel
) -> tuple[float, SimulationResult]:
    """Best wall time of ``args.repeats`` runs, and the result of the last."""
    job = Job(gpus=gpus, layout=Layout.parse(layout))
    best = float("inf")
    result = None
    for _ in range(max(1, args.repeats)):
        start = time.perf_counter()
        result = simulate(
            job,
            llama3_failures(),
            horizon_s=args.days * 86400.0,
            seeds=args.seeds,
            costs=costs,
            keep_events=False,
        )
        best = min(best, time.perf_counter() - start)
    assert result is not None
    return best, result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        costs = CostModel() if args.calibration is None else CostModel.from_json(args.calibration)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results: dict[int, tuple[float, SimulationResult]] = {}
    for gpus, layout in SIZES:
        results[gpus] = run(gpus, layout, args, costs)
    ok = True
    print(
        f"timings: {args.seeds} seeds x {args.days:g} days, Llama 3 failure rate, every strategy (best of {args.repeats})"
    )
    for gpus, (seconds, result) in results.items():
        budget = BUDGETS_S.get(gpus)
        verdict = (
            ""
            if budget is None
            else f"  (budget {budget:g} s: {'ok' if seconds <= budget else 'MISSED'})"
        )
        ok &= budget is None or seconds <= budget
        print(
            f"  {gpus:>7,} GPUs: {seconds:6.2f} s, {result.failures_per_seed.mean():8,.1f} failures per seed{verdict}"
        )
    print()
    names = [r.name for r in next(iter(results.values()))[1].strategies]
    header = f"{'goodput (95% CI half-width)':<28}" + "".join(
        f"{f'{g:,} GPUs':>22}" for g in results
    )
    print(header)
    print("-" * len(header))
    for name in names:
        cells = []
        for _, result in results.values():
            m, lo, hi = result[name].goodput_ci()
            cells.append(f"{m:.4f} ± {(hi - lo) / 2:.4f}")
        print(f"{name:<28}" + "".join(f"{c:>22}" for c in cells))
    print()
    for _, result in results.values():
        print(result.table())
        print()
    if args.json:
        payload = {str(g): {"seconds": s, **r.to_dict()} for g, (s, r) in results.items()}
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
