"""Train a LLaMA-style model with pipeline x data parallelism on Ray.

    python scripts/train.py                        # the default demo run
    python scripts/train.py --stages 2 --replicas 2 --steps 50
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python scripts/train.py

Writes a run folder (``--out``) with metrics.jsonl, summary.json, config.json and loss.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from parallelism import Topology
from recovery import Trainer, TrainSpec
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
        **overrides,
    )
    topology = Topology(stages=args.stages, replicas=args.replicas)
    run_dir = RunDir(args.out) if args.out else RunDir.new("runs", "train")
    trainer = Trainer(
        spec,
        topology=topology,
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
