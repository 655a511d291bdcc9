"""Worker groups: the job's worker processes as the runtime sees them, and the Ray plumbing.

Nothing here imports `recovery.runtime`: the runtime (the controller, the membership)
drives workers through `WorkerGroup`, and this package knows nothing of phases or plans.

- ``group``: `WorkerGroup`, the interface ([Note: calls and failures]); `Call`,
  `CallResults`, `WorkerLost`.
- ``thread_group``: `ThreadWorkerGroup`, every worker a thread of this process (tests).
- ``ray_group``: `RayWorkerGroup`, every worker a Ray actor pinned to its node.
- ``ray_env``: connecting to Ray, a local cluster, loopback only ([Note: loopback only]).
- ``pool``: `WorkerPool`, warm actors kept between jobs and as hot spares.
- ``resources``: what each worker asks of the cluster (`worker_ask`).
- ``placement``: which node each worker runs on (`place`, `replacement_node`).

`RayWorkerGroup` is not imported here: importing the package does not import Ray.
"""

from recovery.groups.group import Call, CallResults, WorkerGroup, WorkerLost
from recovery.groups.thread_group import ThreadWorkerGroup

__all__ = ["Call", "CallResults", "ThreadWorkerGroup", "WorkerGroup", "WorkerLost"]
