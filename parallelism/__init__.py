"""How training is laid out and run across workers. Knows nothing of failures.

- ``topology``: `Topology` (stages x replicas), ranks, stage groups and pipelines.
- ``spec``: `TrainSpec`, what one job trains: stages, loss, optimizer, data.
- ``checks``: validators every config shares (and renamed keys refused).
- ``schedule/``: pipeline schedules as data: actions, generators, validation.
- ``engine``: `StageEngine`, one stage's schedule, all-reduce and optimizer step.
- ``buffers``: a step's buffer values, pending until the commit, then averaged.
- ``seeding``: counter-based seeds, a worker's random streams.
- ``comm/``: `StageComm`, one worker's process groups for one generation.
- ``commit_vote``: `CommitVote`, the per-step vote over a tree of TCP links.
- ``errors``: `CommError`, a failure to talk to peers, marked where it arises.
- ``devices``: the compute device and the backend's wire device.
- ``progress``: a worker's progress as a GPU sees it (for hang detection).
- ``zero``: ZeRO-1, optimizer state sharded over the stage group.
- ``split``: `ModelSplit`, a whole model cut into stages by torch pipelining.
- ``datasets``: `batches_from_dataset`, the dataset cursor.
- ``workloads/``: the built-in workloads (LLaMA, DLRM, a BatchNorm CNN) and their data.
"""

from parallelism.topology import Topology, Worker

__all__ = ["Topology", "Worker"]
