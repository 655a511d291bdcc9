"""Resuming on another topology: a worker's state gathered by parameter name from the
durable snapshot of a job laid out otherwise (another stage cut, another replica count).

[Note: resharding a snapshot]
A durable snapshot holds one DCP folder per worker, its tensors keyed by the stage
module's own names (``model.<name>``, ``optim.state.<name>.<key>``: `recovery.state.dcp_state`).
Stages made by `TrainSpec.from_module` keep the whole model's parameter names, so a name
says where a tensor belongs in any cut. A stage module whose names are its own (LLaMA numbers
its blocks from 0 in every stage: [Note: stage-local block names]) says what each is called
in the whole model with a ``global_name(name) -> str`` method (`global_names`); a durable
write records the names that differ in its manifest (``info.names``), so the snapshot can
be read without building the old stages.

A reshard (`load_resharded`) runs in every worker of the new job: it reads the manifest and
DCP metadata of replica 0 of each old stage (replicas of a stage are bit-identical), and
from the stages that hold any of its tensors -- every byte of them checksummed first --
loads exactly the tensors its own module and optimizer hold under the same global names --
parameters, persistent buffers, and the optimizer's per-parameter state translated by name,
never by position -- verified by checksum first, and refuses a name found in no old stage or
in two (an older LLaMA snapshot without recorded names would say so). The optimizer's
hyper-parameters (``param_groups``) are the new optimizer's own: the job identity checks they
are the same job's, and the learning rate is set from the step every step.

The step (the data cursor: [Note: one worker state]) is the snapshot's. A CheckFree(+)
rebuild's mark goes with the parameters: a new stage takes the mark of the old stages its
parameters come from when they all carry the same one (or none); a new stage whose
parameters come from a rebuilt stage and from a stage with another mark (or none) is
refused, naming them, since one stage trains at one learning-rate scale. Row-sharded
tables (`dlrm_spec`) take their rows by row range (`load_resharded_tables`).

What a reshard does not change is checked by the controller before any worker loads
(`check_reshard`): the same job (model, optimizer, data, loss, seed: the job identity),
and, when the replica count changes, batches that state the global batch
(``batches_from_dataset(global_batch_size=...)``), so every later step reads exactly the
samples it would have. Per-step random streams (dropout) are keyed by ``(stage, replica,
step)`` (``parallelism/seeding.py``), so a model that draws them draws others after a
reshard; the data and the state are exact. Gradients are clipped per stage
(``TrainSpec.clip_grad_norm``), so a step that clips does so otherwise on another cut
(a warning says so).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn

from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.snapshots.checkpoint import checkpoint_path
from recovery.snapshots.folder import MANIFEST
from recovery.state import Progress, WorkerState, dcp_state, load_dcp_state
from recovery.wire import decode, encode

if TYPE_CHECKING:
    from recovery.snapshots.durable import DurableStore

__all__ = [
    "RESUME_MODES",
    "Resume",
    "check_reshard",
    "global_names",
    "load_resharded",
    "load_resharded_tables",
    "renamed",
]

Resume = Literal["auto", "reshard", "never"]
"""What a job does with the durable snapshots in its folder (`Trainer(resume=...)`):
``"auto"`` resumes the same job on the same topology (another one is refused, naming both);
``"reshard"`` also on another topology; ``"never"`` starts afresh and refuses a folder that
holds snapshots."""
RESUME_MODES: tuple[Resume, ...] = get_args(Resume)

log = logging.getLogger("checkfree")

_MODEL = "model."
_STATE = "optim.state."


def global_names(module: nn.Module) -> dict[str, str]:
    """Each ``state_dict`` key of a stage module -> its name in the whole model: the key
    itself, unless the module defines ``global_name(key)`` (see [Note: resharding a snapshot])."""
    rename = getattr(module, "global_name", None)
    keys = module.state_dict().keys()
    return {k: str(rename(k)) if callable(rename) else k for k in keys}


def renamed(module: nn.Module) -> dict[str, str]:
    """The keys of `global_names` whose global name differs (what a manifest records)."""
    return {k: g for k, g in global_names(module).items() if k != g}


def check_reshard(spec: TrainSpec, old: Topology, new: Topology) -> None:
    """Refuse a reshard of ``spec`` from ``old`` to ``new`` that cannot be exact.

    Raises:
        ValueError: for a replica count that changes without a stated global batch, a
            ZeRO-1 optimizer (its state is sharded by replica), or CheckFree+ training
            (its edge replicas hold one parameter on two stages) -- each naming why.
    """
    what = f"resharding {_layout(old)} to {_layout(new)}"
    if old.replicas != new.replicas and getattr(spec.batches, "global_batch_size", None) is None:
        raise ValueError(
            f"{what} changes the replica count, but the job's batches do not state a global "
            "batch: each replica would read its own batch, so every step's global batch would "
            "change (and with it the losses). Give batches_from_dataset(global_batch_size=...) "
            "(or a batches callable with a global_batch_size attribute), or resume with "
            f"{old.replicas} replicas"
        )
    if spec.clip_grad_norm is not None and old.stages != new.stages:
        log.warning(
            "%s: gradients are clipped per stage (clip_grad_norm=%s), so on another stage "
            "cut a step that clips updates otherwise than it would have",
            what,
            spec.clip_grad_norm,
        )
    if spec.shard_optimizer:
        raise ValueError(
            f"{what}: the optimizer state is ZeRO-1 sharded by replica (shard_optimizer), "
            "which a reshard does not re-split; resume on the same topology"
        )
    if spec.routes != "natural" or spec.shared_params is not None:
        raise ValueError(
            f"{what}: CheckFree+ training holds the embedding and head on two stages each; "
            "a reshard does not re-place those replicas. Resume on the same topology"
        )


def _layout(t: Topology) -> str:
    return f"{t.stages} x {t.replicas}"


def _listing(store: DurableStore, step: int, rank: int) -> tuple[Path, dict[str, str], set[str]]:
    """Old ``rank``'s folder, the names its manifest records, and its DCP keys (read before
    the rank's files are verified: the controller verified the whole snapshot just before,
    and `DurableStore.verified_rank` checks every byte of a rank again before anything is loaded from it)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = checkpoint_path(store.root, step, rank)
    info = json.loads((path / MANIFEST).read_bytes()).get("info", {})
    keys = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    return path, dict(info.get("names", {})), keys


def _global_key(key: str, names: dict[str, str]) -> str | None:
    """A DCP key of an old stage with the stage's names made global (None: not a tensor of
    a parameter or buffer: the hyper-parameters, the progress)."""
    if key.startswith(_MODEL):
        local = key[len(_MODEL) :]
        return _MODEL + names.get(local, local)
    if key.startswith(_STATE):
        local, _, part = key[len(_STATE) :].rpartition(".")
        return f"{_STATE}{names.get(local, local)}.{part}"
    return None


def load_resharded(
    store: DurableStore,
    step: int,
    old: Topology,
    state: WorkerState,
    *,
    skip: Callable[[str], bool] = lambda key: False,
) -> Progress:
    """Load into ``state`` what its module and optimizer hold, by global name, from the
    durable snapshot of ``step`` that a job of topology ``old`` wrote in ``store``. See [Note: resharding a snapshot]. ``skip``: global keys
    (``model.<name>``) left to the caller. Returns the progress to adopt.

    Raises:
        SnapshotCorrupted: if a file read fails its checksum (before anything is loaded
            from that rank).
        ValueError: for a name found in no old stage or in two, or parameters from stages
            with different rebuild marks.
    """
    import torch.distributed.checkpoint as dcp

    own = global_names(state.module)
    loaded = dcp_state(state)
    targets: dict[str, torch.Tensor] = {}
    for local, tensor in loaded["model"].items():
        key = _MODEL + own.get(local, local)
        if not skip(key):
            targets[key] = tensor
    for local, entry in loaded["optim"]["state"].items():
        name = own.get(local, local)
        if skip(_MODEL + name):
            continue
        for part, value in entry.items():
            if isinstance(value, torch.Tensor):
                targets[f"{_STATE}{name}.{part}"] = value
    found: dict[str, int] = {}
    marks: dict[int, Progress] = {}
    for stage in range(old.stages):
        path, names, keys = _listing(store, step, old.rank(stage, 0))
        request: dict[str, Any] = {}
        for key in sorted(keys):
            wanted = _global_key(key, names)
            if wanted is None or wanted not in targets:
                continue
            if wanted in found:
                raise ValueError(
                    f"{wanted} is in old stages {found[wanted]} and {stage} of the durable "
                    f"snapshot of step {step}: a stage's names are not the model's (a stage "
                    "module built by a factory records its global names from this version on)"
                )
            found[wanted] = stage
            request[key] = targets[wanted]
        if not request:
            continue  # nothing of this stage's is ours: not read (nor its mark taken)
        store.verified_rank(step, old.rank(stage, 0))
        request["progress"] = ""
        dcp.load(request, checkpoint_id=str(path), no_dist=True)
        progress = decode(str(request["progress"]).encode())
        if not isinstance(progress, Progress) or progress.step != step:
            raise ValueError(f"{path}: holds {progress!r}, not the progress of step {step}")
        marks[stage] = progress
    missing = sorted(set(targets) - set(found))
    if missing:
        shown = ", ".join(missing[:5]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 5 else ""
        )
        raise ValueError(
            f"the durable snapshot of step {step} ({_layout(old)}) holds no {shown}: it is "
            "not this model's (or its stage modules name their parameters otherwise)"
        )
    sources = sorted(set(found.values()))
    rebuilds = {marks[s].rebuild for s in sources}
    if len(rebuilds) > 1:
        raise ValueError(
            f"this stage's parameters come from old stages {sources} of the durable snapshot "
            f"of step {step}, which carry different CheckFree rebuild marks "
            f"({[marks[s].rebuild for s in sources]}); one stage trains at one learning-rate "
            "scale. Resume on a cut that keeps each rebuilt stage's parameters together (or "
            "on the same topology)"
        )
    progress = Progress(step=step, rebuild=rebuilds.pop() if rebuilds else None)
    loaded["progress"] = encode(progress).decode()
    load_dcp_state(state, loaded)
    return progress


def load_resharded_tables(
    store: DurableStore, step: int, old: Topology, state: WorkerState, rows: list[tuple[int, int]]
) -> Progress:
    """`load_resharded` for a worker of row-sharded tables (`dlrm_spec`, one stage): the
    dense part and its optimizer by name from old worker 0, and the rows ``rows`` (this
    shard's ``(start, stop)`` of each table) -- weights and row-wise optimizer state --
    from the old shards that own them (`ShardLayout` of the old worker count).

    Raises:
        SnapshotCorrupted, ValueError: as `load_resharded`.
    """
    import torch.distributed.checkpoint as dcp

    from parallelism.workloads.dlrm.sharding import EmbeddingShard, ShardLayout

    progress = load_resharded(
        store, step, old, state, skip=lambda key: key.startswith("model.shard.")
    )
    shard = state.module.get_submodule("shard")
    assert isinstance(shard, EmbeddingShard), type(shard)
    before = ShardLayout(shard.layout.table_rows, old.replicas)
    weight, accumulator = shard.weight, shard.accumulator
    offsets = shard.layout.offsets(shard.shard)
    for j in range(old.replicas):
        theirs = before.shard_rows(j)
        if all(max(a, c) >= min(b, d) for (a, b), (c, d) in zip(rows, theirs, strict=True)):
            continue  # none of its rows are ours
        path = store.verified_rank(step, old.rank(0, j))
        size = before.shard_size(j)
        request: dict[str, Any] = {
            "model.shard.weight": torch.empty(size, weight.shape[1], dtype=weight.dtype),
            "model.shard.accumulator": torch.empty(size, dtype=accumulator.dtype),
        }
        dcp.load(request, checkpoint_id=str(path), no_dist=True)
        for t, ((a, b), (c, d)) in enumerate(zip(rows, theirs, strict=True)):
            lo, hi = max(a, c), min(b, d)
            if lo >= hi:
                continue
            src = slice(before.offsets(j)[t] + lo - c, before.offsets(j)[t] + hi - c)
            dst = slice(offsets[t] + lo - a, offsets[t] + hi - a)
            with torch.no_grad():
                weight[dst] = request["model.shard.weight"][src]
                accumulator[dst] = request["model.shard.accumulator"][src]
    return progress
