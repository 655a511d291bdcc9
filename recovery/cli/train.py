"""Train a LLaMA-style model with pipeline x data parallelism on Ray, with failures injected
(or a DLRM recommendation model with its embedding tables sharded over the workers).

    checkfree train --failures auto        # the demo: 4x2, two workers killed
    checkfree train                        # the same job, no failure injected
    checkfree train --zero1 --replicas 3   # ZeRO-1: optimizer shards mirrored on the ring
    checkfree train --model dlrm           # 4 workers, tables row-sharded, partial recovery
    checkfree train --stages 2 --replicas 2 --steps 50 --failures none
    checkfree train --failures "kill:step=20,stage=1,replica=0;poisson:rate=0.002"
    checkfree train --replicas 1 --approximate checkfree --failures kill:step=100,stage=2,replica=0
    checkfree train --durable-every 50 --out runs/long   # re-run the same line to resume
    checkfree train --durable-every 50 --global-batch 32 --out runs/long --resume reshard --replicas 4
    checkfree train --replicas 3 --fingerprint-every      # silent-corruption vote, K=100
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python scripts/train.py

The same program is the ``checkfree-train`` command, and ``python scripts/train.py`` in a
checkout.

Writes a run folder (``--out``) with metrics.jsonl, events.jsonl, summary.json, config.json
and loss.png (failures and recoveries marked), and prints a table of recoveries at the end.
"""

from __future__ import annotations

import argparse
import sys
import time

from parallelism import Topology
from parallelism.workloads.dlrm import dlrm_spec
from parallelism.workloads.llama import LlamaConfig, LlamaPreset
from parallelism.workloads.llama_spec import llama_spec
from recovery import Trainer
from recovery.cli.help import HelpFormatter
from recovery.events import summary_table
from recovery.faults import FailureSchedule, Kill, KillPoint
from recovery.integrity.fingerprint import RECOMMENDED_FINGERPRINT_EVERY
from recovery.names import Mode
from recovery.policy import (
    MODES,
    MirrorPolicy,
    RecoveryPolicy,
    RestartBaseline,
    SnapshotPolicy,
    Timeouts,
)
from recovery.rundir import RunDir
from recovery.snapshots.reshard import RESUME_MODES


def build_parser() -> argparse.ArgumentParser:
    """The program's flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("layout")
    g.add_argument(
        "--model",
        choices=["llama", "dlrm"],
        default="llama",
        help="llama: a LLaMA-style decoder on text (default); dlrm: a recommendation model on "
        "click logs, its embedding tables row-sharded over the workers (1 stage)",
    )
    g.add_argument("--stages", type=int, default=None, help="pipeline stages (default 4; dlrm: 1)")
    g.add_argument(
        "--replicas", type=int, default=None, help="data-parallel replicas (default 2; dlrm: 4)"
    )
    g.add_argument(
        "--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="pipeline schedule"
    )
    g.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None, help="default: nccl if CUDA, else gloo"
    )
    g.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="what workers compute on (default: CPU under gloo, the GPU under nccl); "
        "--backend gloo --device cuda: CUDA compute, Gloo communication (workers may share a GPU)",
    )
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--preset",
        default=None,
        help="model size preset: tiny (dim 32, 4 blocks, 32 tokens), demo (~1.7M: dim 128, "
        "8 blocks, 128 tokens; the default), small (~25M), medium (~85M); "
        "dlrm: tiny or small (387,500 rows; the default)",
    )
    g.add_argument(
        "--dim", type=int, default=0, help="model width (overrides the preset; 0 keeps it)"
    )
    g.add_argument(
        "--layers",
        type=int,
        default=0,
        help="transformer blocks (overrides the preset; 0 keeps it)",
    )
    g.add_argument(
        "--heads", type=int, default=0, help="attention heads (overrides the preset; 0 keeps it)"
    )
    g.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="tokens per sample (0: the preset's context length; longer extends the context)",
    )
    g.add_argument("--microbatches", type=int, default=4, help="microbatches per replica per step")
    g.add_argument("--microbatch-size", type=int, default=4, help="samples per microbatch")
    g.add_argument(
        "--data",
        default=None,
        help="text/.bin/.npy file or folder of .txt (default: Python stdlib source)",
    )
    g.add_argument("--batch-size", type=int, default=256, help="dlrm: samples per worker per step")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    g.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    g = p.add_argument_group("failures and recovery")
    g.add_argument(
        "--failures",
        default="none",
        help="faults to inject: 'none' (the default), 'auto' (the demo: kill worker (1,0) a "
        "third of the way in, mid-pipeline, and (2,1) two thirds in, during the all-reduce), "
        "or a list like "
        "'kill:step=20,stage=1,replica=0[,at=mid_pipeline];hang:step=30,stage=2,replica=1;"
        "slow:step=25,stage=1,replica=1,factor=3;killnode:step=40,node=0;poisson:rate=0.002,seed=1'",
    )
    g.add_argument("--strategy", choices=MODES, default=Mode.AUTO.value,
                   help="auto: rebuild lost workers from live redundancy; restart: the checkpoint/restart baseline")  # fmt: skip
    g.add_argument(
        "--hot-spares", type=int, default=1, help="warm spare workers kept ready (default 1)"
    )
    g.add_argument(
        "--elastic",
        action="store_true",
        help="when no warm spare is ready or there is no room for a replacement, train on "
        "without the lost workers (same global batch) and grow back once replacements are "
        "ready (see docs/elastic.md)",
    )
    g.add_argument(
        "--stragglers",
        action="store_true",
        help="replace a worker persistently slower than the other replicas of its stage, "
        "like a dead one (RecoveryPolicy(stragglers=True); see docs/stragglers.md)",
    )
    g.add_argument(
        "--hang-timeout",
        type=float,
        default=120.0,
        help="seconds without progress that count as a hang",
    )
    g.add_argument(
        "--fingerprint-every",
        type=int,
        nargs="?",
        const=RECOMMENDED_FINGERPRINT_EVERY,
        default=0,
        metavar="K",
        help="every K steps compare the replicas' state digests to find silent data "
        f"corruption (no K: {RECOMMENDED_FINGERPRINT_EVERY}, the recommended; 0: off, the "
        "default; needs 2+ replicas; see docs/silent-data-corruption.md)",
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
        "--resume",
        choices=RESUME_MODES,
        default="auto",
        help="what to do with durable snapshots in <out>/snapshots: auto resumes the same "
        "job on the same topology, reshard also on another one (--stages, --replicas; state "
        "by parameter name, the global batch kept), never starts afresh and refuses a "
        "folder that holds snapshots (default auto; see docs/resume.md)",
    )
    g.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per step over all replicas, kept on any topology that divides it "
        "(needed to --resume reshard onto another replica count); default: "
        "--microbatch-size x --microbatches per replica (llama), --batch-size per worker (dlrm)",
    )
    g.add_argument(
        "--zero1",
        action="store_true",
        help="shard each stage's optimizer state over its replicas (ZeRO-1), every shard "
        "mirrored on the next replica; needs --replicas >= 2",
    )
    g.add_argument(
        "--embedding",
        choices=["partial", "exact"],
        default="partial",
        help="dlrm: restore a lost shard's stale rows within --pls-budget (partial, CPR) or "
        "roll back whenever a row is stale (exact)",
    )
    g.add_argument(
        "--pls-budget", type=float, default=0.05, help="dlrm: portion of lost samples accepted"
    )
    g.add_argument(
        "--mirror-hot-rows",
        type=int,
        default=1024,
        help="dlrm: most-used rows per shard mirrored every step",
    )
    g.add_argument(
        "--mirror-every",
        type=int,
        default=10,
        help="dlrm: every row mirrored every N steps (1: all exact)",
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
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dlrm = args.model == "dlrm"
    overrides: dict[str, int] = {}
    if dlrm:
        spec = dlrm_spec(
            preset=args.preset or "small",
            data=args.data,
            batch_size=args.batch_size,
            seed=args.seed,
            global_batch_size=args.global_batch,
        )
    else:
        overrides = {
            name: value
            for name, value in (
                ("dim", args.dim),
                ("n_layers", args.layers),
                ("n_heads", args.heads),
            )
            if value
        }
        preset: LlamaPreset = args.preset or "demo"
        if args.seq_len > LlamaConfig.preset(preset).max_seq_len:
            overrides["max_seq_len"] = args.seq_len
        spec = llama_spec(
            preset=preset,
            data=args.data,
            seq_len=args.seq_len or None,
            microbatch_size=args.microbatch_size,
            microbatches=args.microbatches,
            lr=args.lr,
            warmup_steps=args.warmup,
            schedule=args.schedule,
            seed=args.seed,
            checkfree_plus=args.approximate == "checkfree+",
            shard_optimizer=args.zero1,
            global_batch_size=args.global_batch,
            **overrides,
        )
    topology = Topology(
        stages=(1 if dlrm else 4) if args.stages is None else args.stages,
        replicas=(4 if dlrm else 2) if args.replicas is None else args.replicas,
    )
    # dlrm: strike between two full mirrors, where some rows of a lost shard are stale.
    failures = _failures(args.failures, topology, args.steps, offset=5 if dlrm else 0)
    policy = RecoveryPolicy(
        strategy=args.strategy,
        hot_spares=args.hot_spares,
        elastic=args.elastic,
        stragglers=args.stragglers,
        timeouts=Timeouts(hang=args.hang_timeout),
        fingerprint_every=args.fingerprint_every or None,
        baseline=RestartBaseline(checkpoint_every=args.checkpoint_every),
        approximate=None if args.approximate == "none" else args.approximate,
        exact_only=args.exact_only,
        snapshots=SnapshotPolicy(
            peer_every=args.snapshot_every or None, durable_every=args.durable_every or None
        ),
        mirrors=MirrorPolicy(
            embedding=args.embedding,
            pls_budget=args.pls_budget,
            hot_rows=args.mirror_hot_rows,
            every=args.mirror_every,
        ),
    )
    run_dir = RunDir(args.out) if args.out else RunDir.new("runs", "train")
    trainer = Trainer(
        spec,
        topology=topology,
        policy=policy,
        failures=failures,
        backend=args.backend,
        device=args.device,
        run_dir=run_dir.path,
        progress=not args.no_progress,
        eval_every=args.eval_every,
        collect_states=False,
        resume=args.resume,
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
    if result.mirrors:
        m = result.mirrors
        print(
            f"shard mirrors per worker: {m['mirror_memory_bytes'] / 1e6:.2f} MB held "
            f"(the shard itself: {m['shard_bytes'] / 1e6:.2f} MB), "
            f"{m['update_bytes_per_step'] / 1e3:.1f} kB sent per step"
        )
    print(
        f"{result.steps_per_s:.2f} steps/s, startup {result.startup_s:.1f} s, total {total:.1f} s; "
        f"plot: {run_dir.file('loss.png')}"
    )
    print("\nrecoveries:")
    print(summary_table(result.events))
    for event in result.events:
        if event.embedding:
            e = event.embedding
            print(
                f"step {event.step}: {e['rows_exact']:.0f} rows restored exact, "
                f"{e['rows_stale']:.0f} stale; {e['lost_samples']:.1f} samples' updates lost, "
                f"job PLS {e['pls_job']:.2e}"
            )
    return 0


def _failures(text: str, topology: Topology, steps: int, offset: int = 0) -> FailureSchedule:
    if text != "auto":
        return FailureSchedule.parse(text, topology=topology, steps=steps)
    faults = []
    if topology.replicas > 1 and steps >= 3:
        first = (min(1, topology.stages - 1), 0, KillPoint.MID_PIPELINE)
        second = (min(2, topology.stages - 1), 1, KillPoint.DURING_ALLREDUCE)
        for (stage, replica, at), step in zip(
            (first, second), (steps // 3 + offset, 2 * steps // 3 + offset), strict=True
        ):
            if step >= steps:
                continue
            faults.append(Kill(step=step, stage=stage, replica=replica, at=at))
    return FailureSchedule(faults)


if __name__ == "__main__":
    sys.exit(main())


def cli() -> int:
    """``checkfree-train`` and ``python scripts/train.py``: `main`, with a refused setting
    printed as one line and status 2 (`recovery.cli.help.refusals_as_errors`)."""
    from recovery.cli.help import refusals_as_errors

    return refusals_as_errors("checkfree train", main)
