"""A training job for the driver-death test: run it, kill it, run it again.

python tests/resume_job.py RUN_DIR STEPS OUT.pt

Run as a file, so ``tests/`` is first on the path and `workloads` is ``tests/workloads.py``
(the job `tests/test_rollback.py` compares against); the rest comes from the installed
package.
"""

from __future__ import annotations

import sys

import torch
from workloads import tiny_llama

from parallelism import Topology
from recovery import Trainer
from recovery.policy import RecoveryPolicy, SnapshotPolicy


def main() -> None:
    run_dir, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    policy = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None, durable_every=2))
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
