"""Per-worker checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout: ``<root>/step_<step>/rank_<rank>/`` holds one worker's model and optimizer state
and its step. A worker writes into a temporary folder and renames it into place, so a
folder that exists is complete. This is what the ``restart`` baseline writes every
``checkpoint_every`` steps -- the checkpoint/restart practice of torchrun and Ray Train
that the recovery strategies are measured against.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def checkpoint_path(root: str | os.PathLike[str], step: int, rank: int) -> Path:
    return Path(root) / f"step_{step:08d}" / f"rank_{rank:04d}"


def _state(module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(module, optimizer)
    return {"model": model_state, "optim": optim_state, "step": step}


def save_checkpoint(
    root: str | os.PathLike[str],
    rank: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
) -> Path:
    """Write worker ``rank``'s state at ``step`` (synchronously). Returns its folder."""
    final = checkpoint_path(root, step, rank)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    dcp.save(_state(module, optimizer, step), checkpoint_id=tmp, no_dist=True)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_checkpoint(
    root: str | os.PathLike[str],
    rank: int,
    step: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Load worker ``rank``'s state of ``step`` into ``module`` and ``optimizer``. Returns the step.

    Raises:
        FileNotFoundError: if that checkpoint does not exist.
    """
    path = checkpoint_path(root, step, rank)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint of rank {rank} at step {step} in {root}")
    state = _state(module, optimizer, -1)
    dcp.load(state, checkpoint_id=path, no_dist=True)
    set_state_dict(
        module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["step"])
