"""Check the GPU path end to end and print a table (issue 15); CI does not run it.

    checkfree gpu-check                          # on a machine with GPUs
    checkfree gpu-check --cpu --bench-preset none  # the same checks over Gloo on the CPU
    checkfree gpu-check --budget-s 900           # more time, e.g. for a slower GPU

The checks: a 2x2 job equals single-process training on the same device
(`recovery.reference.train_reference`; deterministic algorithms on; the tolerance is
printed); a kill mid-pipeline and one during the gradient all-reduce end ``torch.equal``
to an uninterrupted run; a hung worker is detected and replaced, and the job ends equal
too; ``checkfree bench recovery`` on the device, at about 100 MB of parameters
(`BENCH_PRESET`; it runs ``scripts/bench.py`` of the checkout, so an installation without
one fails that check: ``--bench-preset none`` leaves it out).
A 2x2 job over NCCL needs four GPUs (NCCL refuses two ranks on one device); with one to
three the checks run in mode 5, compute on CUDA with Gloo communication
(``Trainer(backend="gloo", device="cuda")``: the workers share the GPUs, each staging
what it sends through pinned host memory). Workers computing on CUDA turn deterministic
algorithms on themselves (parallelism/devices.py), and so does this driver for the
single-process run. The whole script has a time budget (`BUDGET_S`, ``--budget-s``): a
check that would start after it is listed as not run. Without a GPU (and without
``--cpu``) it says so and exits 0. Exit status: 0 when every check ran and passed, 1
otherwise. In a checkout, ``python scripts/gpu_check.py`` is the same program.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from parallelism import Topology
from parallelism.devices import Backend, Device, deterministic_cuda
from recovery import (
    FailureSchedule,
    FitResult,
    Hang,
    Kill,
    KillPoint,
    RecoveryPolicy,
    Timeouts,
    Trainer,
)
from recovery.cli.help import HelpFormatter
from recovery.cli.workloads import spec
from recovery.reference import train_reference

ROOT = Path(__file__).resolve().parents[2]
"""The checkout this package runs from (an editable install), where scripts/bench.py is."""

TOP = Topology(stages=2, replicas=2)
STEPS = 6
LOSS_RTOL = 1e-5
"""The 2x2 job against single-process training: the same arithmetic in another order
(microbatches, the all-reduce), so equal to rounding only."""
BUDGET_S = 8 * 60.0
"""Seconds the whole script may take (issue 15: the checks fit in 8 minutes)."""
BENCH_PRESET = "small"
"""`scripts/bench.py recovery`'s model: the LLaMA ``small`` preset, 25.6M parameters, 102 MB in
float32 -- the issue's "about 100 MB of parameters"."""
NOT_RUN = "not run (time budget)"

Row = tuple[str, str, str]
"""(check, result, detail): one line of the table."""


Mode = tuple[Backend, Device]
"""(backend, device) a check runs with."""


def choose_mode(gpus: int, cpu: bool = False) -> Mode | None:
    """What the checks run on: ``--cpu``: Gloo on the CPU; no GPU: nothing (None); fewer
    GPUs than the job's workers: mode 5, Gloo with CUDA compute; else NCCL."""
    if cpu:
        return ("gloo", "cpu")
    if gpus == 0:
        return None
    if gpus < TOP.world_size:
        return ("gloo", "cuda")
    return ("nccl", "cuda")


def _mode(args: argparse.Namespace) -> Mode | None:
    """The mode to check, or None (with the reason printed) when there is none."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mode = choose_mode(gpus, args.cpu)
    if mode is None:
        print("gpu_check: no GPU found (torch.cuda.is_available() is False); nothing to check")
    elif mode == ("gloo", "cuda"):
        print(
            f"gpu_check: {gpus} GPU(s): {torch.cuda.get_device_name(0)}; a "
            f"{TOP.stages}x{TOP.replicas} job over NCCL needs {TOP.world_size}, so mode 5: "
            "backend gloo, device cuda (workers share the GPU)"
        )
    elif mode[0] == "nccl":
        print(f"gpu_check: {gpus} GPU(s): {torch.cuda.get_device_name(0)}; backend nccl")
    return mode


def _fit(mode: Mode, failures: FailureSchedule | None = None, **policy: Any) -> FitResult:
    backend, device = mode
    trainer = Trainer(
        spec(0),
        topology=TOP,
        policy=RecoveryPolicy(**policy),
        failures=failures,
        backend=backend,
        device=device,
    )
    return trainer.fit(STEPS)


def _equal_states(a: FitResult, b: FitResult) -> bool:
    for s in range(TOP.stages):
        for r in range(TOP.replicas):
            sa, sb = a.state(s, r), b.state(s, r)
            if sa.keys() != sb.keys():
                return False
            if not all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa):
                return False
    return True


def check_equivalence(mode: Mode, clean: FitResult) -> tuple[bool, str]:
    """The 2x2 job's losses against single-process training on the job's device."""
    device = mode[1]
    ref = train_reference(
        spec(0), stages=TOP.stages, replicas=TOP.replicas, steps=STEPS, device=device
    )
    got = torch.tensor(clean.losses)
    want = torch.tensor(ref.losses)
    worst = float(((got - want).abs() / want.abs().clamp_min(1e-12)).max())
    return worst <= LOSS_RTOL, (
        f"max relative loss difference {worst:.2e} (tolerance {LOSS_RTOL:g}; "
        f"single process on {device})"
    )


def check_kill(mode: Mode, clean: FitResult, at: KillPoint) -> tuple[bool, str]:
    failures = FailureSchedule([Kill(step=3, stage=1, replica=0, at=at)])
    run = _fit(mode, failures)
    events = run.events
    same = _equal_states(run, clean)
    strategies = ",".join(str(e.strategy) for e in events)
    return same and len(events) == 1, f"{len(events)} recovery ({strategies}); torch.equal: {same}"


def check_hang(mode: Mode, clean: FitResult) -> tuple[bool, str]:
    failures = FailureSchedule([Hang(step=3, stage=1, replica=1, at=KillPoint.MID_PIPELINE)])
    start = time.monotonic()
    run = _fit(mode, failures, timeouts=Timeouts(hang=timedelta(seconds=5)))
    events = run.events
    hung = [e for e in events if getattr(e, "cause", "") == "hung"]
    same = _equal_states(run, clean)
    took = time.monotonic() - start
    return bool(hung) and same, f"{len(hung)} hang(s) detected, torch.equal: {same}, {took:.0f} s"


def check_bench(mode: Mode, preset: str, deadline: float) -> tuple[bool, str]:
    """`scripts/bench.py recovery` in ``mode``, cut off at ``deadline`` (`time.monotonic`)."""
    bench = ROOT / "scripts" / "bench.py"
    if not bench.is_file():
        return False, (
            f"no {bench}: the benchmark runs from a checkout (pip install -e .); "
            "--bench-preset none leaves it out"
        )
    cmd = [sys.executable, str(bench), "recovery", "--presets", preset]
    cmd += ["--stages", str(TOP.stages), "--replicas", str(TOP.replicas)]
    cmd += ["--backend", mode[0], "--device", mode[1]]
    left = max(1.0, deadline - time.monotonic())
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return False, f"stopped by the time budget after {left:.0f} s"
    last = [line for line in done.stdout.splitlines() if line.strip()][-3:]
    return done.returncode == 0, " | ".join(last)[:300] or done.stderr[-300:]


def run_checks(
    checks: list[tuple[str, Callable[[], tuple[bool, str]]]],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
) -> list[Row]:
    """Run ``checks`` in order, one row each. A check that would start at or after
    ``deadline`` (on ``clock``) is not run and its row says so; a check that raises is a
    failed check, and the rest still run."""
    rows: list[Row] = []
    for name, check in checks:
        if clock() >= deadline:
            rows.append((name, NOT_RUN, "the budget was spent before it could start"))
            print(f"  {name}: {NOT_RUN}", flush=True)
            continue
        try:
            ok, detail = check()
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append((name, "pass" if ok else "FAIL", detail))
        print(f"  {name}: {'pass' if ok else 'FAIL'}", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The program's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run the checks over Gloo on the CPU")
    parser.add_argument(
        "--bench-preset",
        default=BENCH_PRESET,
        help=f"model preset for `bench.py recovery` (default {BENCH_PRESET}: 25.6M "
        "parameters, ~100 MB; see bench.py; 'none' skips it)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"seconds the whole script may take (default {BUDGET_S:g}); checks that "
        "would start later are not run",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")
    deadline = start + args.budget_s
    mode = _mode(args)
    if mode is None:
        return 0
    if mode[1] == "cuda":  # the single-process run in this process, as the workers do
        deterministic_cuda()
    clean = _fit(mode)
    checks: list[tuple[str, Callable[[], tuple[bool, str]]]] = [
        ("2x2 equals single process", lambda: check_equivalence(mode, clean)),
        ("kill mid-pipeline", lambda: check_kill(mode, clean, KillPoint.MID_PIPELINE)),
        ("kill during all-reduce", lambda: check_kill(mode, clean, KillPoint.DURING_ALLREDUCE)),
        ("hang detected and replaced", lambda: check_hang(mode, clean)),
    ]
    if args.bench_preset != "none":
        checks.append(("bench.py recovery", lambda: check_bench(mode, args.bench_preset, deadline)))
    rows = run_checks(checks, deadline)
    width = max(len(name) for name, _, _ in rows)
    kind = max(len("result"), *(len(result) for _, result, _ in rows))
    print(f"\n| {'check':<{width}} | {'result':<{kind}} | detail |")
    print(f"|{'-' * (width + 2)}|{'-' * (kind + 2)}|--------|")
    for name, result, detail in rows:
        print(f"| {name:<{width}} | {result:<{kind}} | {detail} |")
    skipped = sum(result == NOT_RUN for _, result, _ in rows)
    took = time.monotonic() - start
    if skipped:
        print(
            f"\ngpu_check: {skipped} check(s) not run: the {args.budget_s:g} s time budget "
            f"was spent ({took:.0f} s); rerun with a larger --budget-s to run them"
        )
    else:
        print(f"\ngpu_check: every check ran, in {took:.0f} s (budget {args.budget_s:g} s)")
    return 0 if all(result == "pass" for _, result, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
