"""Train a LLaMA-style model with pipeline x data parallelism on Ray, with failures injected.

    python scripts/train.py                        # the default demo: 4x2, two workers killed
    python scripts/train.py --stages 2 --replicas 2 --steps 50 --failures none
    python scripts/train.py --failures "kill:step=20,stage=1,replica=0;poisson:rate=0.002"
    python scripts/train.py --replicas 1 --approximate checkfree --failures kill:step=100,stage=2,replica=0
    python scripts/train.py --durable-every 50 --out runs/long   # re-run the same line to resume
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python scripts/train.py

Writes a run folder (``--out``) with metrics.jsonl, events.jsonl, summary.json, config.json
and loss.png (failures and recoveries marked), and prints a table of recoveries at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from parallelism import Topology
from recovery import Trainer, TrainSpec
from recovery.events import summary_table
from recovery.faults import FailureSchedule, Kill, KillPoint
from recovery.policy import RecoveryPolicy
from recovery.rundir import RunDir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("layout")
    g.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    g.add_argument("--replicas", type=int, default=2, help="data-parallel replicas (default 2)")
    g.add_argument(
        "--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="pipeline schedule"
    )
    g.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None, help="default: nccl if CUDA, else gloo"
    )
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--preset",
        default="tiny",
        help="model size preset: tiny, small (~25M), medium (default tiny)",
    )
    g.add_argument(
        "--dim", type=int, default=128, help="model width (overrides the preset; 0 keeps it)"
    )
    g.add_argument(
        "--layers",
        type=int,
        default=8,
        help="transformer blocks (overrides the preset; 0 keeps it)",
    )
    g.add_argument(
        "--heads", type=int, default=4, help="attention heads (overrides the preset; 0 keeps it)"
    )
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    g.add_argument("--microbatches", type=int, default=4, help="microbatches per replica per step")
    g.add_argument("--microbatch-size", type=int, default=4, help="samples per microbatch")
    g.add_argument(
        "--data",
        default=None,
        help="text/.bin/.npy file or folder of .txt (default: Python stdlib source)",
    )
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    g.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    g = p.add_argument_group("failures and recovery")
    g.add_argument(
        "--failures",
        default="auto",
        help="faults to inject: 'auto' (kill worker (1,0) a third of the way in, mid-pipeline, and "
        "(2,1) two thirds in, during the all-reduce), 'none', or a list like "
        "'kill:step=20,stage=1,replica=0[,at=mid_pipeline];hang:step=30,stage=2,replica=1;"
        "killnode:step=40,node=0;poisson:rate=0.002,seed=1'",
    )
    g.add_argument("--strategy", choices=["auto", "restart"], default="auto",
                   help="auto: rebuild lost workers from live redundancy; restart: the checkpoint/restart baseline")  # fmt: skip
    g.add_argument(
        "--hot-spares", type=int, default=1, help="warm spare workers kept ready (default 1)"
    )
    g.add_argument(
        "--hang-timeout",
        type=float,
        default=120.0,
        help="seconds without progress that count as a hang",
    )
    g.add_argument(
        "--approximate",
        choices=["none", "checkfree", "checkfree+"],
        default="none",
        help="rebuild a stage that lost every replica from its neighbours (CheckFree); "
        "checkfree+ also trains for losing the first or last stage (default none)",
    )
    g.add_argument(
        "--exact-only", action="store_true", help="never rebuild approximately: roll back instead"
    )
    g.add_argument(
        "--snapshot-every",
        type=int,
        default=50,
        help="peer-memory snapshots every N steps (0: off; default 50)",
    )
    g.add_argument(
        "--durable-every",
        type=int,
        default=0,
        help="durable snapshots every N steps, in <out>/snapshots; re-running the same "
        "command with the same --out resumes from the newest one (0: off)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="restart baseline: checkpoint interval in steps",
    )
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    g.add_argument(
        "--eval-every", type=int, default=25, help="validation loss every N steps (0: never)"
    )
    g.add_argument("--out", default=None, help="run folder (default runs/<time>-train)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {
        name: value
        for name, value in (("dim", args.dim), ("n_layers", args.layers), ("n_heads", args.heads))
        if value
    }
    overrides["max_seq_len"] = max(args.seq_len, 1)
    spec = TrainSpec.llama(
        preset=args.preset,
        data=args.data,
        seq_len=args.seq_len,
        microbatch_size=args.microbatch_size,
        microbatches=args.microbatches,
        lr=args.lr,
        warmup_steps=args.warmup,
        schedule=args.schedule,
        seed=args.seed,
        checkfree_plus=args.approximate == "checkfree+",
        **overrides,
    )
    topology = Topology(stages=args.stages, replicas=args.replicas)
    failures = _failures(args.failures, topology, args.steps)
    policy = RecoveryPolicy(
        strategy=args.strategy,
        hot_spares=args.hot_spares,
        hang_timeout_s=args.hang_timeout,
        checkpoint_every=args.checkpoint_every,
        approximate=None if args.approximate == "none" else args.approximate,
        exact_only=args.exact_only,
        snapshot_every=args.snapshot_every or None,
        durable_every=args.durable_every or None,
    )
    run_dir = RunDir(args.out) if args.out else RunDir.new("runs", "train")
    trainer = Trainer(
        spec,
        topology=topology,
        policy=policy,
        failures=failures,
        backend=args.backend,
        run_dir=run_dir.path,
        progress=not args.no_progress,
        eval_every=args.eval_every,
        collect_states=False,
    )
    print(
        f"checkfree: {spec.name} {overrides}, {topology} workers, {args.steps} steps -> {run_dir.path}"
    )
    start = time.perf_counter()
    result = trainer.fit(args.steps)
    total = time.perf_counter() - start
    first, last = result.losses[0], sum(result.losses[-10:]) / len(result.losses[-10:])
    print(f"loss {first:.3f} -> {last:.3f} (mean of last 10) in {len(result.losses)} steps")
    if result.val_losses:
        print(f"validation loss {result.val_losses[-1][1]:.3f} at step {result.val_losses[-1][0]}")
    print(
        f"{result.steps_per_s:.2f} steps/s, startup {result.startup_s:.1f} s, total {total:.1f} s; "
        f"plot: {run_dir.file('loss.png')}"
    )
    print("\nrecoveries:")
    print(summary_table(result.events))
    return 0


def _failures(text: str, topology: Topology, steps: int) -> FailureSchedule:
    if text != "auto":
        return FailureSchedule.parse(text, topology=topology, steps=steps)
    faults = []
    if topology.replicas > 1 and steps >= 3:
        first = (min(1, topology.stages - 1), 0, KillPoint.MID_PIPELINE)
        second = (min(2, topology.stages - 1), 1, KillPoint.DURING_ALLREDUCE)
        for (stage, replica, at), step in zip(
            (first, second), (steps // 3, 2 * steps // 3), strict=True
        ):
            faults.append(Kill(step=step, stage=stage, replica=replica, at=at))
    return FailureSchedule(faults)


if __name__ == "__main__":
    sys.exit(main())
