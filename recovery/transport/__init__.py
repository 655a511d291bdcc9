"""Moving a worker's state between workers: the bytes, not the decision.

- ``transport``: `StateTransport`, the interface -- send a `WorkerState` to a peer,
  receive one into a worker's own tensors.
- ``process_group``: `ProcessGroupTransport` (Gloo or NCCL), the checked description
  ([Note: checked transfers]), `DigestsAhead`, and the by-name send of a CheckFree rebuild.
- ``same_host``: `SameHostTransport`, a copy out of the sender's memory on one host, with
  the process group as its fallback ([Note: same-host transfer]).

The description they send is the wire format of `recovery.wire` (also what snapshots and
the state itself are encoded with, so it sits below this package).
"""

from recovery.transport.process_group import (
    DigestsAhead,
    ProcessGroupTransport,
    recv_named,
    send_named,
    state_bytes,
)
from recovery.transport.same_host import SameHostTransport
from recovery.transport.transport import StateTransport

__all__ = [
    "DigestsAhead",
    "ProcessGroupTransport",
    "SameHostTransport",
    "StateTransport",
    "recv_named",
    "send_named",
    "state_bytes",
]
