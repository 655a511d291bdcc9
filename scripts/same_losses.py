"""Refactor check: the same losses and final states for a fixed seed, before and after.

torchtitan's rule for refactors: a change that only reshapes the code must give the same
losses with a fixed seed. This runs a small fixed set of real Ray jobs -- one per recovery
path (replica copy, CheckFree, rollback, ZeRO-1 shard mirror, embedding shard mirror, the
restart baseline) -- and prints, per job, the losses, the recovery strategies and a digest
of every worker's final state. Run it on two trees and compare:

    python scripts/same_losses.py --out /tmp/after.json
    PYTHONPATH=/path/to/old/tree python /path/to/old/tree/../scripts/same_losses.py --out /tmp/before.json
    python scripts/same_losses.py --compare /tmp/before.json /tmp/after.json

Only the public API is used, so the script runs unchanged against older trees; it stays a
file of scripts/ for that reason (``checkfree same-losses`` runs it from the checkout).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _digest(result: Any, topology: Any) -> str:
    h = hashlib.sha256()
    for s in range(topology.stages):
        for r in range(topology.replicas):
            for key, value in sorted(result.state(s, r).items()):
                h.update(key.encode())
                h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _jobs() -> dict[str, Callable[[], tuple[Any, Any]]]:
    import torch
    from torch import nn

    from parallelism import Topology
    from parallelism.workloads.dlrm import dlrm_spec
    from parallelism.workloads.llama_spec import llama_spec
    from recovery import (
        FailureSchedule,
        Kill,
        KillPoint,
        MirrorPolicy,
        RecoveryPolicy,
        RestartBaseline,
        SnapshotPolicy,
        Trainer,
        TrainSpec,
    )
    from recovery.names import Mode

    def stage(s: int, n: int) -> nn.Module:
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def batches(step: int, replica: int, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * step + replica)
        x = torch.randn(8, 16, generator=g)
        return x, torch.sin(x)

    def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    mlp = TrainSpec(build_stage=stage, loss_fn=mse, make_optimizer=adamw, batches=batches)
    zero = TrainSpec(
        build_stage=stage, loss_fn=mse, make_optimizer=adamw, batches=batches, shard_optimizer=True
    )

    def run(spec: Any, top: Any, policy: Any, *faults: Any, steps: int = 8) -> tuple[Any, Any]:
        trainer = Trainer(spec, topology=top, policy=policy, failures=FailureSchedule(list(faults)))
        return trainer.fit(steps), top

    return {
        "llama_2x2_replica_copy": lambda: run(
            llama_spec(preset="tiny", seq_len=32, microbatch_size=2, max_bytes=2_000_000),
            Topology(2, 2),
            RecoveryPolicy(),
            Kill(step=3, stage=1, replica=0, at=KillPoint.MID_PIPELINE),
        ),
        "mlp_3x1_checkfree": lambda: run(
            mlp,
            Topology(3, 1),
            RecoveryPolicy(approximate="checkfree", snapshots=SnapshotPolicy(peer_every=None)),
            Kill(step=4, stage=1, replica=0),
        ),
        "mlp_2x2_peer_rollback": lambda: run(
            mlp,
            Topology(2, 2),
            RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=2)),
            Kill(step=5, stage=1, replica=0),
            Kill(step=5, stage=1, replica=1),
        ),
        "mlp_zero1_1x2_shard_mirror": lambda: run(
            zero, Topology(1, 2), RecoveryPolicy(), Kill(step=3, stage=0, replica=1)
        ),
        "dlrm_1x4_shard_mirror": lambda: run(
            dlrm_spec(preset="tiny", batch_size=16, seed=3),
            Topology(1, 4),
            RecoveryPolicy(mirrors=MirrorPolicy(every=1)),
            Kill(step=3, stage=0, replica=2),
        ),
        "mlp_2x1_restart": lambda: run(
            mlp,
            Topology(2, 1),
            RecoveryPolicy(strategy=Mode.RESTART, baseline=RestartBaseline(checkpoint_every=2)),
            Kill(step=5, stage=0, replica=0),
        ),
    }


def measure(names: list[str] | None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, job in _jobs().items():
        if names and name not in names:
            continue
        result, top = job()
        out[name] = {
            "losses": [repr(x) for x in result.losses],
            "strategies": [str(e.strategy) for e in result.events],
            "state": _digest(result, top),
        }
        print(f"{name}: {len(result.losses)} steps, {out[name]['strategies']}", file=sys.stderr)
    return out


def compare(before: dict[str, Any], after: dict[str, Any]) -> int:
    bad = 0
    for name in sorted(before.keys() | after.keys()):
        same = before.get(name) == after.get(name)
        bad += not same
        print(f"{'same' if same else 'DIFFERENT':9}  {name}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", help="also write the measurements to this JSON file (default: print only)"
    )
    parser.add_argument(
        "--only",
        nargs="*",
        metavar="JOB",
        help="run only these jobs (default: all: llama_2x2_replica_copy, mlp_3x1_checkfree, "
        "mlp_2x2_peer_rollback, mlp_zero1_1x2_shard_mirror, dlrm_1x4_shard_mirror, "
        "mlp_2x1_restart)",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="compare two outputs instead of measuring; exit 1 if they differ",
    )
    args = parser.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as a, open(args.compare[1]) as b:
            return compare(json.load(a), json.load(b))
    found = measure(args.only)
    text = json.dumps(found, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
