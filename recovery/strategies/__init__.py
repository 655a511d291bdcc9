"""Recovery strategies as pure functions: how lost state is rebuilt from what survives.

- ``checkfree``: CheckFree's neighbour averaging and CheckFree+'s edge copy.
- ``embedding``: partial recovery of row-sharded embedding tables (CPR, MFU shard mirrors).
- ``pls``: the PLS ledger, the portion of lost samples a partial recovery may spend.

`checkfree` holds CheckFree's neighbour averaging and CheckFree+'s edge copy, with their
ablations, the rebuilt stage's optimizer state and learning rate, and the gradient-norm
bookkeeping the weights need. The Ray runtime and the in-process simulator both call
these functions. `embedding` holds partial recovery of row-sharded embedding tables (CPR
with MFU shard mirrors): mirrors, shard restore, the portion of lost samples and the decision between partial
recovery (``embedding="partial" | "exact"``) and rollback.
"""

from recovery.strategies.checkfree import (
    DEFAULT_EPS,
    AblationMethod,
    Averaging,
    CheckFreeConfig,
    GradNormTracker,
    MomentState,
    Rebuilt,
    StageState,
    clip_stage_gradients,
    copy_neighbor,
    edge_copy,
    load_optimizer_moments,
    neighbor_average,
    neighbor_weights,
    optimizer_moments,
    random_reinit,
    rebuild_stage,
    sum_shared_gradients,
    uniform_average,
)
from recovery.strategies.embedding import (
    EMBEDDING_POLICIES,
    MFUTracker,
    MirrorCost,
    MirrorPlan,
    MirrorUpdate,
    RestoredShard,
    ShardCopy,
    decide,
    mirror_cost,
    mirror_update,
    portion_of_lost_samples,
    restore_shard,
)

__all__ = [
    "DEFAULT_EPS",
    "EMBEDDING_POLICIES",
    "AblationMethod",
    "Averaging",
    "CheckFreeConfig",
    "GradNormTracker",
    "MFUTracker",
    "MirrorCost",
    "MirrorPlan",
    "MirrorUpdate",
    "MomentState",
    "Rebuilt",
    "RestoredShard",
    "ShardCopy",
    "StageState",
    "clip_stage_gradients",
    "copy_neighbor",
    "decide",
    "edge_copy",
    "load_optimizer_moments",
    "mirror_cost",
    "mirror_update",
    "neighbor_average",
    "neighbor_weights",
    "optimizer_moments",
    "portion_of_lost_samples",
    "random_reinit",
    "rebuild_stage",
    "restore_shard",
    "sum_shared_gradients",
    "uniform_average",
]
