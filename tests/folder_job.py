"""A job that holds a durable snapshot folder until it is killed, for the folder-lock test.

python -m tests.folder_job FOLDER

Its workers are threads of this process (`tests.jobs.make`); it trains `paced_stage` with a
durable snapshot every step, for as long as it lives.
"""

from __future__ import annotations

import sys

from parallelism import Topology
from recovery import RecoveryPolicy, SnapshotPolicy
from tests.jobs import make
from tests.workloads import mlp_spec, paced_stage

POLICY = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None, durable_every=1))


def main() -> None:
    controller, _ = make(
        mlp_spec(build_stage=paced_stage), Topology(2, 1), policy=POLICY, snapshot_dir=sys.argv[1]
    )
    controller.run(1_000_000)


if __name__ == "__main__":
    main()
