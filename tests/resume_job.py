"""A training job for the driver-death test: run it, kill it, run it again.

python tests/resume_job.py RUN_DIR STEPS OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from parallelism import Topology
from recovery import Trainer
from recovery.policy import RecoveryPolicy
from tests.workloads import tiny_llama


def main() -> None:
    run_dir, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    policy = RecoveryPolicy(snapshot_every=None, durable_every=2)
    result = Trainer(tiny_llama(), topology=Topology(2, 2), policy=policy, run_dir=run_dir).fit(
        steps
    )
    torch.save(
        {
            "losses": result.losses,
            "states": result.states,
            "events": [e.to_dict() for e in result.events],
        },
        out,
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
