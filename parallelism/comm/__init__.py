"""One worker's communication during one generation: `StageComm` and what it is built of.

- `parallelism.comm.stage_comm`: `StageComm`, a worker's process groups for one generation
  (point to point, the stage's collectives, the side group, the commit vote).
- `parallelism.comm.groups`: process groups built (Gloo, NCCL), aborted, disposed of and
  waited on; the backends and their devices.
- `parallelism.comm.gloo_sockets`: the TCP connections under a worker's Gloo groups, cut
  on teardown ([Note: tearing down on failure]).
- `parallelism.comm.rendezvous`: the controller's store and where a generation meets.
- `parallelism.comm.wire`: tensors staged between the compute device and the wire, and
  the activation header; `GarbledMessage`, `ReceiveBudget`, `empty_received`.

`CommError` (from `parallelism.errors`) is what every call here that talks to peers
raises when that fails.
"""

from parallelism.comm.groups import (
    BACKENDS,
    NCCL_ENV,
    NcclSettings,
    abort_groups,
    default_backend,
    device_for,
    nccl_env,
    nccl_options,
)
from parallelism.comm.rendezvous import Rendezvous, host_store, listen_socket
from parallelism.comm.stage_comm import StageComm
from parallelism.comm.wire import (
    Activation,
    GarbledMessage,
    ReceiveBudget,
    StagedWork,
    Waitable,
    empty_received,
    from_wire,
    land,
    message_budget,
    to_wire,
    wire_buffer,
)
from parallelism.errors import CommError

__all__ = [
    "BACKENDS",
    "NCCL_ENV",
    "Activation",
    "CommError",
    "GarbledMessage",
    "NcclSettings",
    "ReceiveBudget",
    "Rendezvous",
    "StageComm",
    "StagedWork",
    "Waitable",
    "abort_groups",
    "default_backend",
    "device_for",
    "empty_received",
    "from_wire",
    "host_store",
    "land",
    "listen_socket",
    "message_budget",
    "nccl_env",
    "nccl_options",
    "to_wire",
    "wire_buffer",
]
