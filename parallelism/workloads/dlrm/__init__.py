"""A DLRM-style recommendation model whose embedding tables are row-sharded over the workers.

The model (Naumov et al., 2019): every sparse feature looks up one row of its embedding
table; a bottom MLP maps the dense features to a vector of the same width; the pairwise
dot products of these ``T + 1`` vectors, with the bottom output, feed a top MLP that gives
the click logit. Most parameters are in the tables, so they are *model-parallel*: the rows
of every table are split over all ``W`` workers (`ShardLayout`), each worker holding its
rows of every table in one `EmbeddingShard`. The MLPs (`DenseDLRM`) are small and
*data-parallel*: every worker holds a replica and the gradients are all-reduced.

One training step of one worker (`DLRMWorker`), see [Note: embedding exchange]: route the
ids of its batch to their owners, exchange requests and rows with two all-to-alls, run the
dense part, send the gradients of the looked-up rows back to their owners (a third
all-to-all), all-reduce the dense gradients, and -- on commit -- apply row-wise Adagrad to
the touched rows only (rows not looked up stay bit-identical) and Adam to the dense part.
The exchanges go through a tiny `Collective` interface with two implementations:
`LocalGroup` (W workers as threads of one process, for tests and experiments) and
`ProcessGroupCollective` (a ``torch.distributed`` Gloo or NCCL process group). `DLRM` is
the same model unsharded in one process, the reference the sharded trainer must match;
`InProcessDLRM` runs W sharded workers in one process.

The modules: `model` (sizes, dense part, sparse optimizer, the unsharded reference,
metrics), `sharding` ([Note: row sharding]), `collectives` (the exchange's
communication), `training` (one worker's step, [Note: embedding exchange]) and `spec`
(`dlrm_spec`: the workload as a `parallelism.spec.TrainSpec`).
"""

from parallelism.workloads.dlrm.collectives import Collective, LocalGroup, ProcessGroupCollective
from parallelism.workloads.dlrm.model import (
    DLRM,
    DenseDLRM,
    DLRMConfig,
    dlrm_loss,
    init_table_rows,
    log_loss,
    predict_unsharded,
    roc_auc,
    rowwise_adagrad_,
)
from parallelism.workloads.dlrm.sharding import EmbeddingShard, ShardLayout, assemble_tables
from parallelism.workloads.dlrm.spec import DLRMPreset, dlrm_spec
from parallelism.workloads.dlrm.training import (
    DLRMTraining,
    DLRMWorker,
    InProcessDLRM,
    Routing,
    StepLoss,
    StepUpdate,
    route_lookups,
)

__all__ = [
    "DLRM",
    "Collective",
    "DLRMConfig",
    "DLRMPreset",
    "DLRMTraining",
    "DLRMWorker",
    "DenseDLRM",
    "EmbeddingShard",
    "InProcessDLRM",
    "LocalGroup",
    "ProcessGroupCollective",
    "Routing",
    "ShardLayout",
    "StepLoss",
    "StepUpdate",
    "assemble_tables",
    "dlrm_loss",
    "dlrm_spec",
    "init_table_rows",
    "log_loss",
    "predict_unsharded",
    "roc_auc",
    "route_lookups",
    "rowwise_adagrad_",
]
