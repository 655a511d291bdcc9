"""Benchmarks, measured side by side in one run and printed as tables.

    checkfree bench throughput     # framework overhead and pipeline bubbles
    checkfree bench recovery       # kill -> first committed step: replica_copy vs restart
    checkfree bench snapshots      # failure-free cost of peer and durable snapshots
    checkfree bench zero           # ZeRO-1 with mirrored shards vs unsharded AdamW
    checkfree bench fingerprint    # silent-corruption fingerprints at K = 1, 10, 50, 100 vs off
    checkfree bench peers          # 1x2 data-parallel job beside torchrun + DDP and torchft
    checkfree bench vote --old /work/base  # the commit vote: old full mesh vs tree, 8-64 workers
    checkfree bench stragglers     # step time before/during/after a worker slowed from outside

Every figure is measured by this run on this machine; nothing is copied from elsewhere.
``checkfree bench BENCHMARK --help`` describes one benchmark and its flags.
``checkfree bench`` runs this file, ``python scripts/bench.py``, from the checkout the
package was installed from (``pip install -e .``): ``peers`` starts torchrun and torchft
peers from scripts/peers.py, and ``vote`` loads another checkout's tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from parallelism import Topology
from parallelism.schedule import theoretical_bubble
from parallelism.workloads.llama_spec import llama_spec
from recovery import Trainer, TrainSpec
from recovery.cli.help import HelpFormatter
from recovery.names import Mode, Strategy
from recovery.reference import train_reference


def sibling(name: str) -> ModuleType:
    """``scripts/<name>.py``, loaded by its path (``scripts/`` is not a package, and this
    does not depend on the folder being on ``sys.path``)."""
    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_checkfree_script_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before running it: its dataclasses look it up
    spec.loader.exec_module(module)
    return module


peers = sibling("peers")
vote_scale = sibling("vote_scale")
stragglers = sibling("stragglers")


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.python_version()}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


def model_spec(
    args: argparse.Namespace, *, schedule: str = "1f1b", microbatches: int | None = None
) -> TrainSpec:
    return llama_spec(
        preset=args.preset,
        seq_len=args.seq_len,
        microbatch_size=args.microbatch_size,
        microbatches=microbatches or args.microbatches,
        schedule=schedule,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq_len,
    )


def _median_after_warmup(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:] if len(values) > warmup else values)


def throughput(args: argparse.Namespace) -> None:
    """Steps/s and tokens/s of a PP x DP job, a 1x1 job and plain training; pipeline bubbles."""
    steps, warm = args.steps, min(3, args.steps // 3)
    rows: list[list[str]] = []
    spec = model_spec(args)
    tokens_per_replica = args.microbatches * args.microbatch_size * args.seq_len

    def ray_row(name: str, top: Topology) -> float:
        result = Trainer(spec, topology=top, collect_states=False).fit(steps)
        step_s = _median_after_warmup([m["step_s"] for m in result.metrics], warm)
        tokens = tokens_per_replica * top.replicas
        rows.append([name, f"{1 / step_s:.2f}", f"{tokens / step_s:,.0f}", f"{step_s * 1e3:.0f}"])
        return step_s

    def plain_row(name: str, replicas: int, fn: Callable[[], list[float]]) -> float:
        step_s = _median_after_warmup(fn(), warm)
        tokens = tokens_per_replica * replicas
        rows.append([name, f"{1 / step_s:.2f}", f"{tokens / step_s:,.0f}", f"{step_s * 1e3:.0f}"])
        return step_s

    torch.set_num_threads(1)
    print(f"machine: {machine()}")
    params = sum(p.numel() for s in range(1) for p in spec.build(s, 1).parameters())
    print(
        f"model: {spec.name} dim={args.dim} layers={args.layers} ({params / 1e6:.1f}M parameters), "
        f"{args.microbatches} microbatches x {args.microbatch_size} x {args.seq_len} tokens per replica\n"
    )
    plain = plain_row(
        "plain single process, 1 thread",
        1,
        lambda: train_reference(spec, stages=1, replicas=1, steps=steps).step_s,
    )
    accumulated = plain_row(
        f"plain single process, {args.microbatches} accumulated microbatches",
        1,
        lambda: (
            train_reference(
                spec, stages=1, replicas=1, steps=steps, accumulate=args.microbatches
            ).step_s
        ),
    )
    one = ray_row("Ray 1x1 (1 worker, 1 thread)", Topology(1, 1))
    ray_row(f"Ray {args.stages}x{args.replicas}", Topology(args.stages, args.replicas))
    print(table(["run", "steps/s", "tokens/s", "ms/step"], rows))
    print(
        f"\nframework overhead, Ray 1x1 vs plain: {100 * (one / plain - 1):+.1f}% time per step; "
        f"vs plain with the same microbatches: {100 * (one / accumulated - 1):+.1f}%\n"
    )

    bubble_rows = []
    for stages in (2, 4):
        for schedule in ("gpipe", "1f1b"):
            for mb in (4, 8):
                s = model_spec(args, schedule=schedule, microbatches=mb)
                result = Trainer(s, topology=Topology(stages, 1), collect_states=False).fit(steps)
                measured = _measured_bubble(result.metrics, warm)
                theory = theoretical_bubble(stages, mb)
                bubble_rows.append(
                    [
                        f"{stages}x1",
                        schedule,
                        str(mb),
                        f"{theory:.3f}",
                        f"{measured:.3f}",
                        f"{100 * (measured - theory) / theory:+.0f}%",
                    ]
                )
    print(
        table(
            [
                "pipeline",
                "schedule",
                "microbatches",
                "bubble (theory)",
                "bubble (measured)",
                "diff",
            ],
            bubble_rows,
        )
    )
    print(
        "\nmeasured bubble = 1 - (forward+backward compute seconds) / (schedule wall seconds), "
        "summed over stages; theory = (S-1)/(M+S-1)."
    )
    if os.cpu_count() and os.cpu_count() < 4:  # type: ignore[operator]
        print(
            f"note: {os.cpu_count()} cores -- a 4-stage pipeline shares cores, which inflates its bubble."
        )


def snapshots(args: argparse.Namespace) -> None:
    """Failure-free throughput of the same job with and without snapshots, interleaved."""
    import shutil
    import tempfile

    from recovery.policy import RecoveryPolicy, SnapshotPolicy

    spec = model_spec(args)
    top = Topology(args.stages, args.replicas)
    tmp = Path(tempfile.mkdtemp(prefix="checkfree-bench-snapshots-"))
    configs = {
        "no snapshots": {"peer_every": None},
        "peer every 50": {"peer_every": 50},
        "peer every 10": {"peer_every": 10},
        "durable every 100": {"peer_every": None, "durable_every": 100},
        "peer every 50 + durable every 100": {"peer_every": 50, "durable_every": 100},
    }
    warm = 5
    print(f"machine: {machine()}")
    print(
        f"model: {spec.name} dim={args.dim} layers={args.layers}, {top} workers, "
        f"{args.steps} steps per run, {args.repeats} interleaved repeats\n",
        flush=True,
    )
    rates: dict[str, list[float]] = {name: [] for name in configs}
    blocked: dict[str, list[float]] = {name: [] for name in configs}
    for repeat in range(args.repeats):
        for index, (name, knobs) in enumerate(configs.items()):
            # a folder per run: a durable folder that already holds snapshots is resumed
            policy = RecoveryPolicy(
                snapshots=SnapshotPolicy(dir=tmp / f"{repeat}-{index}", **knobs)
            )
            result = Trainer(spec, topology=top, policy=policy, collect_states=False).fit(
                args.steps
            )
            times = [float(m["time"]) for m in result.metrics]
            rates[name].append((len(times) - warm) / (times[-1] - times[warm - 1]))
            blocked[name].append(sum(sum(v) for v in result.timings.values()))
            print(
                f"  {repeat + 1}/{args.repeats} {name}: {rates[name][-1]:.2f} steps/s", flush=True
            )
    shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(rates["no snapshots"])
    rows = [
        [
            name,
            f"{statistics.median(r):.2f}",
            f"{100 * (1 - statistics.median(r) / base):+.1f}%",
            f"{min(r):.2f} - {max(r):.2f}",
            f"{statistics.median(blocked[name]):.2f}",
        ]
        for name, r in rates.items()
    ]
    print()
    print(
        table(
            ["snapshots", "steps/s (median)", "cost vs none", "range", "driver blocked (s)"],
            rows,
        )
    )
    print(
        f"\nsteps/s over steps {warm}..{args.steps - 1} of each run, snapshot steps included;"
        " runs of all configurations are interleaved so that drift in the machine's speed"
        " hits them alike. Driver blocked = seconds the controller waited on snapshot or"
        " checkpoint work in the run."
    )


def _tensor_bytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() if obj.dim() > 0 else 0
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def zero(args: argparse.Namespace) -> None:
    """ZeRO-1 (optimizer shards mirrored on the next replica) against unsharded AdamW:
    failure-free speed, optimizer memory per worker, and the recovery of one lost worker."""
    import dataclasses

    from recovery.faults import FailureSchedule, Kill, KillPoint

    top = Topology(args.stages, args.replicas)
    plain = model_spec(args)
    sharded = dataclasses.replace(plain, shard_optimizer=True, name=plain.name + "-zero1")
    warm = 5
    print(f"machine: {machine()}")
    print(
        f"model: {plain.name} dim={args.dim} layers={args.layers}, {top} workers, "
        f"{args.steps} steps per run, {args.repeats} interleaved repeats\n",
        flush=True,
    )
    rates: dict[str, list[float]] = {"unsharded": [], "zero1": []}
    states: dict[str, dict[tuple[int, int], dict[str, object]]] = {}
    for repeat in range(args.repeats):
        for name, spec in (("unsharded", plain), ("zero1", sharded)):
            result = Trainer(spec, topology=top, collect_states=repeat == 0).fit(args.steps)
            times = [float(m["time"]) for m in result.metrics]
            rates[name].append((len(times) - warm) / (times[-1] - times[warm - 1]))
            if repeat == 0:
                states[name] = result.states
            print(
                f"  {repeat + 1}/{args.repeats} {name}: {rates[name][-1]:.2f} steps/s", flush=True
            )
    recoveries = {}
    kill = FailureSchedule([Kill(step=warm + 3, stage=1, replica=0, at=KillPoint.MID_PIPELINE)])
    for name, spec in (("unsharded", plain), ("zero1", sharded)):
        result = Trainer(spec, topology=top, failures=kill, collect_states=False).fit(warm + 6)
        (event,) = result.events
        recoveries[name] = event
    rows = []
    for name in ("unsharded", "zero1"):
        per_worker = []
        for (stage, replica), state in states[name].items():
            own = _tensor_bytes(state["optimizer"]["state"])  # type: ignore[index]
            mirror = 0
            if name == "zero1":  # the ward's shard: its parameters and optimizer state
                ward = states[name][(stage, (replica - 1) % top.replicas)]["optimizer"]["state"]  # type: ignore[index]
                mirror = _tensor_bytes(ward) + _tensor_bytes(ward) // 2  # AdamW: 2 moments/param
            per_worker.append((own, mirror))
        own_mb = statistics.mean(o for o, _ in per_worker) / 1e6
        mirror_mb = statistics.mean(m for _, m in per_worker) / 1e6
        event = recoveries[name]
        rows.append(
            [
                name,
                f"{statistics.median(rates[name]):.2f}",
                f"{own_mb:.2f}",
                f"{mirror_mb:.2f}",
                f"{own_mb + mirror_mb:.2f}",
                event.strategy,
                f"{event.breakdown['transfer']:.2f}",
                f"{event.seconds:.2f}",
                f"{event.bytes_moved / 1e6:.1f}",
            ]
        )
    print()
    print(
        table(
            [
                "optimizer",
                "steps/s",
                "own opt. MB/worker",
                "mirror MB/worker",
                "total MB/worker",
                "recovery",
                "transfer s",
                "recovery s",
                "MB moved",
            ],
            rows,
        )
    )
    print(
        f"\nsteps/s over steps {warm}..{args.steps - 1} (median of the repeats); memory from the"
        " final optimizer states (the mirror holds the ward's parameters and AdamW moments);"
        f" recovery: worker (1,0) killed mid-pipeline at step {warm + 3}, cold replacement."
    )


def _measured_bubble(metrics: list[dict[str, object]], warm: int) -> float:
    fractions = [float(m["bubble"]) for m in metrics[warm:] if m.get("bubble") is not None]  # type: ignore[arg-type]
    return statistics.median(fractions) if fractions else float("nan")


def recovery(args: argparse.Namespace) -> None:
    """Lose workers of a 4x2 job; time until training is back, per strategy, side by side."""
    import json
    import random
    import tempfile

    from recovery.faults import FailureSchedule, Kill, KillPoint
    from recovery.policy import RecoveryPolicy, RestartBaseline, SnapshotPolicy
    from recovery.snapshots import buddies

    print(f"machine: {machine()}")
    rng = random.Random(args.seed)
    top = Topology(args.stages, args.replicas)
    rows: list[list[str]] = []
    transfer_rows: list[list[str]] = []
    elastic_rows: list[list[str]] = []
    calibration: dict[str, float] = {}
    for preset in args.presets.split(","):
        spec = llama_spec(
            preset=preset,
            seq_len=args.seq_len,
            microbatch_size=1,
            microbatches=args.microbatches,
            max_seq_len=max(args.seq_len, 64),
        )
        params = sum(
            p.numel() for s in range(top.stages) for p in spec.build(s, top.stages).parameters()
        )
        k = args.kill_step
        kill = Kill(step=k, stage=1, replica=0, at=KillPoint.MID_PIPELINE)
        group = [
            Kill(step=k, stage=1, replica=r, at=KillPoint.MID_PIPELINE) for r in range(top.replicas)
        ]
        ring = buddies(top, {r: "node" for r in range(top.world_size)})
        with_buddies = sorted(
            {top.rank(1, r) for r in range(top.replicas)}
            | {ring[top.rank(1, r)] for r in range(top.replicas)}
        )
        group_and_buddies = [
            Kill(step=k, stage=top.worker(r).stage, replica=top.worker(r).replica)
            for r in with_buddies
        ]
        durable_dir = tempfile.mkdtemp(prefix="checkfree-bench-")
        lost = rng.randrange(1, args.restart_every)
        restart_kill = Kill(
            step=args.restart_every + lost, stage=1, replica=0, at=KillPoint.MID_PIPELINE
        )
        every = max(1, k - 1)  # the last snapshot lands one step before the kill
        cases = [
            (
                "replica_copy, cold start",
                RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None)),
                [kill],
                k + 3,
            ),
            (
                "replica_copy, warm spare",
                RecoveryPolicy(hot_spares=1, snapshots=SnapshotPolicy(peer_every=None)),
                [kill],
                k + 3,
            ),
            (
                "rollback, peer tier",
                RecoveryPolicy(
                    exact_only=True,
                    snapshots=SnapshotPolicy(peer_every=every),
                    hot_spares=top.replicas,
                ),
                group,
                k + 3,
            ),
            (
                "rollback, durable tier",
                RecoveryPolicy(
                    exact_only=True,
                    snapshots=SnapshotPolicy(
                        peer_every=every,
                        durable_every=max(1, k // 2),  # an asynchronous write needs time to land
                        dir=durable_dir,
                    ),
                    hot_spares=len(with_buddies),
                ),
                group_and_buddies,
                k + 3,
            ),
            (
                f"restart, checkpoint every {args.restart_every}",
                RecoveryPolicy(
                    strategy=Mode.RESTART,
                    baseline=RestartBaseline(checkpoint_every=args.restart_every),
                    snapshots=SnapshotPolicy(peer_every=None),
                ),
                [restart_kill],
                restart_kill.step + 2,
            ),
        ]
        print(f"\n{preset}: {params / 1e6:.1f}M parameters, {top} workers", flush=True)
        measured: dict[str, object] = {}
        for name, policy, faults, steps in cases:
            result = Trainer(
                spec,
                topology=top,
                policy=policy,
                failures=FailureSchedule(faults),
                collect_states=False,
                backend=args.backend,
                device=args.device,
            ).fit(steps)
            (event,) = result.events
            step_s = statistics.median(m["step_s"] for m in result.metrics)
            back = _back_at_failed_step(result.metrics, event.time, event.step)
            b = event.breakdown
            measured[name] = (event, step_s, result.timings)
            rows.append(
                [
                    preset,
                    name,
                    f"{event.seconds - b['resume']:.2f}",
                    f"{event.seconds:.2f}",
                    " / ".join(
                        f"{b[p]:.2f}" for p in ("detect", "replace", "reform", "transfer", "resume")
                    ),
                    str(event.lost_steps),
                    f"{back:.2f}",
                    f"{step_s:.2f}",
                ]
            )
            print("  " + " | ".join(rows[-1][1:]), flush=True)
            if event.strategy == Strategy.REPLICA_COPY and b["transfer"] > 0:
                memcpy = _memcpy_rate(event.bytes_moved)
                wire = _gloo_rate(event.bytes_moved)
                rate = event.bytes_moved / b["transfer"]
                transfer_rows.append(
                    [
                        preset,
                        name,
                        f"{event.bytes_moved / 1e6:.0f}",
                        f"{rate / 1e9:.2f}",
                        f"{memcpy / 1e9:.2f}",
                        f"{100 * rate / memcpy:.0f}%",
                        f"{wire / 1e9:.2f}",
                    ]
                )
        if not calibration:
            calibration = _calibration(measured, top)
        if args.elastic_steps:
            elastic_rows += _elastic_rows(spec, top, kill, args, preset)
    print()
    print(
        table(
            [
                "model",
                "strategy",
                "kill -> training again (s)",
                "kill -> first commit (s)",
                "detect / replace / reform / transfer / resume (s)",
                "lost steps",
                "kill -> back at failed step (s)",
                "median step (s)",
            ],
            rows,
        )
    )
    print()
    print(
        table(
            [
                "model",
                "strategy",
                "MB moved",
                "transfer GB/s",
                "memcpy GB/s",
                "of memcpy",
                "raw Gloo GB/s",
            ],
            transfer_rows,
        )
    )
    if elastic_rows:
        print()
        print(
            table(
                [
                    "model",
                    "cold replacement",
                    "step before kill (s)",
                    "kill -> training again (s)",
                    "survivors' stall: kill -> next commit (s)",
                    "grow: stall (s)",
                    "shrunk step (s)",
                    "kill -> full strength (s)",
                    "events",
                ],
                elastic_rows,
            )
        )
        print(
            "\nkill -> training again = detect + replace + reform + transfer of the first"
            " recovery; survivors' stall adds the first step after it (a shrunk step, for the"
            " elastic row); grow: stall = the grow's own pause (leave, reform, copy, first"
            " step); full strength = the first commit with every worker back. elastic: the job"
            " shrinks at once and grows back when the replacement (started as a spare) is warm."
        )
    print(
        "\nkill -> training again = detect + replace + reform + transfer; kill -> first commit adds"
        " re-running the failed step (resume). The restart kill lands at a uniformly drawn step"
        f" after the last checkpoint (seed {args.seed})."
    )
    if args.calibration:
        Path(args.calibration).parent.mkdir(parents=True, exist_ok=True)
        Path(args.calibration).write_text(json.dumps(calibration, indent=2) + "\n")
        print(
            f"\ncalibration for the simulator ({args.presets.split(',')[0]}) written to {args.calibration}"
        )


def _calibration(measured: dict[str, object], top: Topology) -> dict[str, object]:
    """Costs measured by one model's recovery runs, as fields of simulations.costs.CostModel."""

    def key(name: str) -> str:  # "rollback, peer tier" -> "rollback_peer"
        head, _, tail = name.partition(", ")
        return f"{head}_{tail.split()[0]}" if tail else head

    by = {key(name): v for name, v in measured.items()}
    cold, _, _ = by["replica_copy_cold"]  # type: ignore[misc]
    warm, step_s, _ = by["replica_copy_warm"]  # type: ignore[misc]
    peer, _, snap_t = by["rollback_peer"]  # type: ignore[misc]
    restart, _, ckpt_t = by["restart_checkpoint"]  # type: ignore[misc]
    state = warm.bytes_moved * top.stages  # one pipeline replica's state
    return {
        "_source": f"scripts/bench.py recovery on {machine()}, {top} workers",
        "detect_s": statistics.median([cold.breakdown["detect"], warm.breakdown["detect"]]),
        "replace_s": cold.breakdown["replace"],
        "replace_warm_s": warm.breakdown["replace"],
        "reform_s": statistics.median([cold.breakdown["reform"], warm.breakdown["reform"]]),
        "restart_s": restart.breakdown["replace"] + restart.breakdown["reform"],
        "step_s": step_s,
        "model_state_bytes": state,
        "model_weight_bytes": state / 3,  # AdamW: weights and two moments
        "transfer_bytes_per_s": warm.bytes_moved / max(warm.breakdown["transfer"], 1e-9),
        "checkpoint_write_s": statistics.median(ckpt_t.get("checkpoint_write", [0.0])),
        "checkpoint_load_s": restart.breakdown["transfer"],
        "snapshot_write_s": statistics.median(snap_t.get("snapshot_write", [0.0])),
        "snapshot_load_s": peer.breakdown["transfer"],
    }


def _elastic_rows(
    spec: TrainSpec, top: Topology, kill: object, args: argparse.Namespace, preset: str
) -> list[list[str]]:
    """The same kill with a cold replacement, without and with an elastic shrink, one after
    the other: the survivors' stall and the time until the job is at full strength again."""
    from recovery.faults import FailureSchedule
    from recovery.policy import RecoveryPolicy, SnapshotPolicy

    rows = []
    for name, elastic in (("wait for it", False), ("elastic shrink", True)):
        result = Trainer(
            spec,
            topology=top,
            policy=RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None), elastic=elastic),
            failures=FailureSchedule([kill]),  # type: ignore[list-item]
            collect_states=False,
            backend=args.backend,
            device=args.device,
        ).fit(args.kill_step + args.elastic_steps)
        first = result.events[0]
        times = [(int(m["step"]), float(m["time"]), float(m["step_s"])) for m in result.metrics]
        before = (
            statistics.median(s for step, _, s in times if step < first.step)
            if first.step
            else math.nan
        )
        stall = min((t for _, t, _ in times if t > first.time), default=math.nan) - first.time
        grown = [e for e in result.events if e.strategy == Strategy.GROW]
        back_at = grown[0].time if grown else (first.time if not elastic else math.inf)
        full = min((t for _, t, _ in times if t > back_at), default=math.nan) - first.time
        shrunk = [s for _, t, s in times if first.time < t <= back_at]
        idle = first.seconds - first.breakdown["resume"]
        grow_stall = f"{grown[0].seconds:.2f}" if grown else "-"
        rows.append(
            [
                preset,
                name,
                f"{before:.3f}",
                f"{idle:.2f}",
                f"{stall:.2f}",
                grow_stall,
                f"{statistics.median(shrunk):.3f}" if elastic and shrunk else "-",
                f"{full:.2f}" if math.isfinite(full) else f"not within {args.elastic_steps} steps",
                "+".join(e.strategy for e in result.events),
            ]
        )
        print("  " + " | ".join(rows[-1][1:]), flush=True)
    return rows


def _back_at_failed_step(metrics: list[dict[str, float]], struck: float, step: int) -> float:
    """Seconds from the failure until the step it interrupted is committed again."""
    for m in metrics:
        if m["time"] > struck and m["step"] >= step:
            return float(m["time"]) - struck
    return float("nan")


def _gloo_rate(nbytes: int) -> float:
    """Bytes/s of one plain Gloo send of ``nbytes`` between two workers on this machine."""
    import threading

    from parallelism.comm import Rendezvous, StageComm, host_store

    store = host_store("127.0.0.1")
    top = Topology(2, 1)
    rdzv = Rendezvous("127.0.0.1", store.port, "bench", 30)
    comms: list[StageComm] = []

    def join(rank: int) -> None:
        comms.append(StageComm(rdzv, top, rank, "gloo", "127.0.0.1"))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = sorted(comms, key=lambda c: c.rank)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a.isend(src, 1)
        b.recv(dst, 0)
        a.wait_sends()
        best = min(best, time.perf_counter() - start)
    a.close()
    b.close()
    return nbytes / best


def _memcpy_rate(nbytes: int) -> float:
    """Bytes/s of one libc memcpy of ``nbytes`` on this machine (`peers.memcpy_seconds`)."""
    return nbytes / peers.memcpy_seconds(nbytes)


_DP_WIDTH = 2048
"""The data-parallel workload: 6 Linear(2048, 2048) layers = 25.2M float32 parameters,
100.7 MB (AdamW state makes the fingerprinted state 3x that)."""


def _dp_stage(stage: int, num_stages: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(_DP_WIDTH, _DP_WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _dp_batches(step: int, replica: int, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(8, _DP_WIDTH, generator=g)
    return x, torch.tanh(x)


def _dp_spec() -> TrainSpec:
    return TrainSpec(
        build_stage=_dp_stage,
        loss_fn=torch.nn.functional.mse_loss,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        batches=_dp_batches,
        microbatches=2,
        name="dp-100MB",
    )


def _step_times(spec: TrainSpec, top: Topology, every: int | None, steps: int) -> dict[int, float]:
    """Seconds of each committed step of a failure-free job over worker threads (no Ray:
    the same workers, controller and Gloo groups, without Ray's start-up), by step."""
    from recovery.groups import ThreadWorkerGroup
    from recovery.policy import RecoveryPolicy, SnapshotPolicy
    from recovery.runtime import Controller, ControllerConfig
    from recovery.runtime.layouts import layout_for

    policy = RecoveryPolicy(fingerprint_every=every, snapshots=SnapshotPolicy(peer_every=None))
    nodes = [f"node-{i}" for i in range(top.replicas)]
    group = ThreadWorkerGroup(layout_for(spec, top, policy, 1).worker_cls, nodes=nodes)
    controller = Controller(spec, top, ControllerConfig(backend="gloo"), policy=policy, group=group)
    try:
        controller.run(steps)
    finally:
        controller.shutdown()
    return {r.step: r.step_s for r in controller.records}


def _digest_rate(nbytes: int) -> float:
    """Bytes/s of one fingerprint digest (XXH3-64) of a ``nbytes`` tensor on one core (best of 5)."""
    from recovery.integrity.fingerprint import digest

    data = torch.randn(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        digest(data)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


_FINGERPRINT_WARM = 2
"""Steps left out of every timed window: step 0 (start-up, and a check at every K) and 1."""


def _fingerprint_runs(every: int | None, steps: int, checks: int) -> int:
    """Steps to run at K=``every`` so that ``checks`` check steps fall in the timed window
    (steps ``_FINGERPRINT_WARM`` on), and at least ``steps``."""
    if every is None:
        return steps
    return max(steps, checks * every + 1, _FINGERPRINT_WARM + checks)


def fingerprint_cost(args: argparse.Namespace) -> None:
    """Per-step cost of fingerprint checks at K = 1, 10, 50 and the recommended K against
    none, on two jobs, measured side by side in one run, with the amortised estimate."""
    from recovery.integrity.fingerprint import RECOMMENDED_FINGERPRINT_EVERY

    torch.set_num_threads(1)
    jobs = {
        f"demo {args.stages}x{args.replicas} ({args.preset} dim={args.dim})": (
            model_spec(args),
            Topology(args.stages, args.replicas),
        ),
        "data-parallel 100 MB (1x2)": (_dp_spec(), Topology(1, 2)),
    }
    ks = sorted({1, 10, 50, RECOMMENDED_FINGERPRINT_EVERY})
    configs: dict[str, int | None] = {"off": None, **{f"K={k}": k for k in ks}}
    warm = _FINGERPRINT_WARM
    lengths = {name: _fingerprint_runs(k, args.steps, args.checks) for name, k in configs.items()}
    print(f"machine: {machine()}")
    print(
        f"per job, one run per configuration ({args.repeats} interleaved repeats), steps run: "
        + ", ".join(f"{name} {n}" for name, n in lengths.items())
        + f"; timed: steps {warm} on; a check step is a step s with s % K == 0"
        f" (snapshots off), so each K run times >= {args.checks} check steps\n",
        flush=True,
    )
    rate = _digest_rate(100 * 2**20)
    print(
        f"XXH3-64 digest: {rate / 1e9:.1f} GB/s on one core (100 MiB tensor, best of 5);"
        f" memcpy {_memcpy_rate(100 * 2**20) / 1e9:.1f} GB/s\n",
        flush=True,
    )
    rows = []
    for job, (spec, top) in jobs.items():
        params = sum(
            p.numel() for s in range(top.stages) for p in spec.build(s, top.stages).parameters()
        )
        # per configuration: each repeat's {step: seconds} over the timed window
        runs: dict[str, list[dict[int, float]]] = {name: [] for name in configs}
        for repeat in range(args.repeats):
            for name, every in configs.items():
                times = _step_times(spec, top, every, lengths[name])
                runs[name].append({s: t for s, t in times.items() if s >= warm})
                print(
                    f"  {job} {repeat + 1}/{args.repeats} {name} ({lengths[name]} steps): "
                    f"{statistics.mean(runs[name][-1].values()) * 1e3:.1f} ms/step",
                    flush=True,
                )
        off = [t for run in runs["off"] for t in run.values()]
        base = statistics.median(off)
        k1_extra = statistics.median([t for r in runs["K=1"] for t in r.values()]) - base
        off_row = [job, f"{params * 4 / 1e6:.1f}", "off", f"{statistics.mean(off) * 1e3:.1f}"]
        rows.append([*off_row, "", "0", "", "", ""])
        for name, every in configs.items():
            if every is None:
                continue
            extras: list[float] = []  # each check step's time over its run's plain step
            spread = []  # per run: the checks' extra time over all its timed steps
            for run in runs[name]:
                plain = [t for s, t in run.items() if s % every]
                ref = statistics.median(plain) if plain else base  # K=1: the off runs'
                mine = [t - ref for s, t in run.items() if s % every == 0]
                extras += mine
                spread.append(sum(mine) / len(run) / ref)
            mean = statistics.mean([t for r in runs[name] for t in r.values()])
            rows.append(
                [
                    "",
                    "",
                    name,
                    f"{mean * 1e3:.1f}",
                    f"{100 * (mean / statistics.mean(off) - 1):+.1f}%",
                    str(len(extras)),
                    f"{statistics.median(extras) * 1e3:+.1f}",
                    f"{100 * statistics.median(spread):+.2f}%",
                    f"{100 * k1_extra / every / base:+.2f}%",
                ]
            )
    print()
    print(
        table(
            [
                "job",
                "params MB",
                "fingerprints",
                "ms/step (mean)",
                "mean vs off",
                "checks timed",
                "check step extra ms",
                "cost/step (measured)",
                "cost/step (estimate: K=1 / K)",
            ],
            rows,
        )
    )
    print(
        f"""
ms/step (mean): mean step time over the run's timed steps; mean vs off: against the off
run's -- whole runs of different lengths at different times, so on a shared machine this
column is noise of several percent, larger than the cost at K >= 10.
check step extra: the median over the timed check steps of (check step - the median plain
step of the same run); for K=1, whose every step is a check, against the off run.
cost/step (measured): the checks' extra time in the run (the sum of the check-step extras)
over all its timed steps, as a fraction of its plain step -- the check's cost measured
directly on the run's own check steps ({args.checks}+ per run), not a difference of means.
cost/step (estimate): the amortised estimate, not measured at that K: the K=1 check step
extra divided by K and by the off run's median step."""
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="BENCHMARK")

    def add(name: str, summary: str, doc: str | None, example: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=summary,
            description=doc,
            epilog=f"example:\n  checkfree bench {name} {example}".rstrip(),
            formatter_class=HelpFormatter,
        )

    t = add(
        "throughput", "framework overhead and pipeline bubbles", throughput.__doc__, "--steps 6"
    )
    sn = add("snapshots", "failure-free cost of peer and durable snapshots", snapshots.__doc__, "")
    sn.add_argument("--repeats", type=int, default=2, help="interleaved runs per configuration")
    z = add("zero", "ZeRO-1 with mirrored shards vs unsharded AdamW", zero.__doc__, "--repeats 1")
    z.add_argument("--repeats", type=int, default=2, help="interleaved runs per configuration")
    f = add(
        "fingerprint",
        "per-step cost of silent-corruption fingerprints at K = 1, 10, 50 and the "
        "recommended K (100), measured, beside the amortised estimate",
        fingerprint_cost.__doc__,
        "--checks 1",
    )
    f.add_argument("--repeats", type=int, default=1, help="interleaved runs per configuration")
    f.add_argument(
        "--checks",
        type=int,
        default=2,
        help="check steps each K run times at least (a run at K is >= checks*K + 1 steps)",
    )
    for q in (t, sn, z, f):
        q.add_argument(
            "--preset", default="tiny", help="model preset (default tiny, resized below)"
        )
        q.add_argument("--dim", type=int, default=128, help="model width")
        q.add_argument("--layers", type=int, default=8, help="transformer blocks")
        q.add_argument("--heads", type=int, default=4, help="attention heads")
        q.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
        q.add_argument("--microbatches", type=int, default=4, help="microbatches per replica")
        q.add_argument("--microbatch-size", type=int, default=4, help="samples per microbatch")
        q.add_argument(
            "--stages", type=int, default=2 if q is z else 4, help="stages of the PP x DP job"
        )
        q.add_argument(
            "--replicas", type=int, default=3 if q is z else 2, help="replicas of the PP x DP job"
        )
        q.add_argument(
            "--steps",
            type=int,
            default={t: 12, sn: 105, z: 25, f: 22}[q],
            help="steps per measured run"
            + (" (a run at a large K takes more, see --checks)" if q is f else ""),
        )
    r = add(
        "recovery",
        "time from a kill to training again, per strategy",
        recovery.__doc__,
        "--presets demo --calibration calibration.json",
    )
    r.add_argument("--presets", default="small,medium", help="model presets, comma-separated")
    r.add_argument("--stages", type=int, default=4, help="pipeline stages")
    r.add_argument("--replicas", type=int, default=2, help="data-parallel replicas")
    r.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None, help="default: nccl if CUDA, else gloo"
    )
    r.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="what workers compute on (default: the backend's own; gloo + cuda: a shared GPU)",
    )
    r.add_argument(
        "--seq-len", type=int, default=64, help="tokens per sample (small, to keep steps short)"
    )
    r.add_argument("--microbatches", type=int, default=4, help="microbatches of one sample")
    r.add_argument(
        "--kill-step", type=int, default=4, help="step at which replica_copy runs lose a worker"
    )
    r.add_argument(
        "--restart-every", type=int, default=50, help="checkpoint interval of the restart baseline"
    )
    r.add_argument(
        "--elastic-steps",
        type=int,
        default=30,
        help="steps after the kill for the elastic rows (cold start, with and without a shrink;"
        " 0: skip them)",
    )
    r.add_argument("--seed", type=int, default=0, help="seed for the restart baseline's kill step")
    r.add_argument(
        "--calibration",
        default=None,
        help="write the measured costs (first preset) here, for the simulator",
    )
    pe = add(
        "peers",
        "steady step and kill -> training again beside torchrun + DDP and torchft",
        peers.__doc__,
        "--sizes 10 --repeats 1",
    )
    peers.add_arguments(pe)
    vo = add(
        "vote",
        "the commit vote's connections and per-exchange cost, old full mesh vs tree, "
        "at 8-64 workers, modelled to 16,384",
        vote_scale.__doc__,
        "--old ../old-checkout --sizes 8,16",
    )
    vote_scale.add_arguments(vo)
    sg = add(
        "stragglers",
        "step time before, during and after a worker slowed 3x from outside, with straggler "
        "replacement on and off",
        stragglers.__doc__,
        "--steps 200 --settle 5",
    )
    stragglers.add_arguments(sg)
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.command == "peers":
        # Its own process: Ray pickles the workload by value only from a __main__ script,
        # and it re-runs itself inside a private network namespace (see scripts/peers.py).
        rest = list(sys.argv[2:] if argv is None else argv[1:])
        return subprocess.run(
            [sys.executable, str(Path(__file__).with_name("peers.py")), *rest]
        ).returncode
    commands = {
        "throughput": throughput,
        "recovery": recovery,
        "snapshots": snapshots,
        "zero": zero,
        "fingerprint": fingerprint_cost,
        "vote": vote_scale.run,
        "stragglers": stragglers.run,
    }
    commands[args.command](args)
    print(f"\n(bench took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
