"""Snapshots: the copies of every worker's state a rollback, a restart or a resume comes back to.

- ``peer``: `PeerSnapshots`, the copies a worker holds for its buddy; `peer_rollback_step`.
- ``packing``: `pack_state` / `unpack_state`, a worker state as one byte tensor, checksummed.
- ``buddies``: the buddy ring (who holds whose peer snapshots).
- ``durable``: `DurableStore`, asynchronous checksummed DCP writes, commit, load.
- ``folder``: `SnapshotFolder`, a durable folder's steps (complete, intact, commit, prune).
- ``checkpoint``: the restart baseline's per-worker checkpoints, and the DCP and atomic-file
  helpers the durable tier shares.
- ``identity``: `job_identity`, what a durable snapshot records about the job, so that a
  re-run only resumes the same job.
- ``reshard``: `load_resharded`, a durable snapshot of another topology loaded by
  parameter name (``Trainer(resume="reshard")``).

Snapshots for the ``rollback`` strategy come in two tiers: peer memory and durable files.

*Peer memory* (`recovery.snapshots.peer`): every ``snapshots.peer_every`` steps each worker
packs its state into one contiguous byte tensor (`pack_state`, in
`recovery.snapshots.packing`), keeps that copy itself and sends it to its buddy
(`buddy_of`, in `recovery.snapshots.buddies`), which holds it in `PeerSnapshots`. It
survives any failure that does not take a worker and its buddy together.

*Durable* (`recovery.snapshots.durable`): every ``snapshots.durable_every`` steps each worker
writes its state with torch.distributed.checkpoint to a folder, asynchronously and
checksummed (`DurableStore`). It survives anything, driver death included.

[Note: snapshot consistency]
A snapshot of step S is, for every rank, the state it holds after committing steps
0..S-1 and before running step S: its step counter (= data cursor) is S, and its RNG
needs no bytes because every draw derives from ``(seed, stage, replica, step)``
(``parallelism/seeding.py``). Under the two-phase step (see ``recovery/worker/stage.py``) no
worker applies step S until every worker is ready, so "the state at S" is one well-defined
set of world-size states, and each worker's part is labelled with S when it is taken.
Both `pack_state` and DCP's async staging copy the tensors before returning, so the
optimizer update that follows cannot leak into a snapshot. Parts are only ever combined
by label: a durable step is COMPLETE only when the controller has seen every rank's write
finish and every rank folder and manifest is in place (`DurableStore.commit`; a folder
without COMPLETE.json is torn and never loaded), and a peer rollback picks a step S for
which every rank's S-labelled part survives (`peer_rollback_step`). One caveat makes
labels unambiguous: after a rollback to S, the states of steps after S belong to an
abandoned timeline (the replay need not reproduce them bit for bit: an approximate
recovery may come in between), so every snapshot newer than S must be dropped before
new ones are taken
(`PeerSnapshots.discard_after`, `DurableStore.discard_after`); otherwise a later rollback
could mix parts of two timelines under one label.
"""

from recovery.snapshots.buddies import buddies, buddy_of, buddy_ring
from recovery.snapshots.durable import (
    COMPLETE,
    DEFAULT_TIMEOUT,
    FORMAT,
    HASH,
    MANIFEST,
    DurableStore,
    WriteHandle,
    WriteResult,
    file_digest,
)
from recovery.snapshots.folder import SnapshotFolder
from recovery.snapshots.packing import PackedState, TensorSlot, pack_state, unpack_state
from recovery.snapshots.peer import PeerSnapshots, peer_rollback_step

__all__ = [
    "COMPLETE",
    "DEFAULT_TIMEOUT",
    "FORMAT",
    "HASH",
    "MANIFEST",
    "DurableStore",
    "PackedState",
    "PeerSnapshots",
    "SnapshotFolder",
    "TensorSlot",
    "WriteHandle",
    "WriteResult",
    "buddies",
    "buddy_of",
    "buddy_ring",
    "file_digest",
    "pack_state",
    "peer_rollback_step",
    "unpack_state",
]
