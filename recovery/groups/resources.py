"""What each worker asks of the cluster: `Trainer(worker_resources={"CPU": 1})`.

A worker's ask is a mapping of Ray resource names to amounts, the same for every worker
and every hot spare. By default a worker asks for no CPU (several workers share a node and
set their own torch threads) and, under NCCL, one GPU (a small share of one when Gloo
workers compute on CUDA, see [Note: a GPU shared over Gloo]) -- so on CPUs the scheduler never
sees a full node. Asking for what a worker really uses (``{"CPU": 1}``) lets Ray, and this
library, see when a replacement has no room: the start then fails after
``RecoveryPolicy.timeouts.replace`` naming the workers it could not place, instead of
waiting for a start timeout. Pure functions; `recovery.groups.ray_group` passes the ask
to Ray's actor options.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = [
    "BUILTIN_RESOURCES",
    "SHARED_GPU",
    "actor_options",
    "describe",
    "fits",
    "worker_ask",
]

BUILTIN_RESOURCES = ("CPU", "GPU", "memory")
"""Ray's own resource names (``memory`` in bytes); any other name is a custom resource
that some node must declare (``ray start --resources``)."""


SHARED_GPU = 0.05
"""A Gloo worker computing on CUDA asks for this much of a GPU by default (up to 20
workers share one; see [Note: a GPU shared over Gloo])."""

# [Note: a GPU shared over Gloo]
# Under ``backend="gloo", device="cuda"`` (parallelism/devices.py) workers compute on a GPU
# but talk over host memory, so several of them may share one GPU -- the reason the mode
# exists (NCCL refuses two ranks on one device). Each still asks Ray for a *fraction* of a
# GPU, never none: Ray shows a worker only the GPUs it was given (CUDA_VISIBLE_DEVICES), so
# a worker that asks for no GPU sees none, and a fraction is also what lets Ray count how
# many workers a GPU holds. The default fraction is small (`SHARED_GPU`): Ray packs
# fractional asks onto one GPU before the next, so a one-GPU machine holds a 2x2 job with
# its hot spares and replacements. To spread workers over several GPUs, ask for a larger
# share (``worker_resources={"GPU": 0.5}``: two per GPU); ``GPU`` 0 is refused.


def worker_ask(
    resources: Mapping[str, object] | None, backend: str, device: str | None = None
) -> dict[str, float]:
    """Each worker's ask: ``resources`` checked, with the defaults filled in (no CPU; one
    GPU under NCCL; `SHARED_GPU` of one under Gloo with ``device="cuda"``). Amounts of 0
    are dropped.

    Raises:
        ValueError: for a mapping that is not one, a name that is not a non-empty string
            (or a mis-cased built-in, ``"cpu"``), an amount that is not a finite number
            >= 0 (``bool`` included), a fractional amount above 1 (Ray accepts only whole
            numbers there), or ``GPU`` 0 under NCCL or with ``device="cuda"``.
    """
    if resources is None:
        resources = {}
    if not isinstance(resources, Mapping):
        raise ValueError(
            f"worker_resources must be a mapping such as {{'CPU': 1}}, got "
            f"{type(resources).__name__}"
        )
    ask: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"worker_resources: resource names are strings, got {name!r}")
        builtin = next((b for b in BUILTIN_RESOURCES if b.lower() == name.lower()), None)
        if builtin is not None and builtin != name:
            raise ValueError(
                f"worker_resources: unknown resource {name!r}; did you mean {builtin!r}?"
            )
        ok = isinstance(amount, int | float) and not isinstance(amount, bool)
        if not ok or not math.isfinite(amount) or amount < 0:  # type: ignore[arg-type, operator]
            raise ValueError(
                f"worker_resources[{name!r}] must be a finite number >= 0, got {amount!r}"
            )
        value = float(amount)  # type: ignore[arg-type]
        if value > 1 and not value.is_integer() and name != "memory":
            raise ValueError(
                f"worker_resources[{name!r}] = {amount!r}: above 1, Ray accepts only whole "
                "amounts (use a fraction below 1, or a whole number)"
            )
        ask[name] = value
    if backend == "nccl":
        if ask.get("GPU", 1.0) == 0:
            raise ValueError("backend 'nccl' needs a GPU per worker: worker_resources['GPU'] is 0")
        ask.setdefault("GPU", 1.0)
    elif device == "cuda":
        if ask.get("GPU", SHARED_GPU) == 0:
            raise ValueError(
                "device 'cuda' needs a share of a GPU per worker: worker_resources['GPU'] "
                "is 0, and Ray shows a worker that asks for no GPU none (see [Note: a GPU "
                "shared over Gloo] in recovery/groups/resources.py)"
            )
        ask.setdefault("GPU", SHARED_GPU)
    return {name: value for name, value in ask.items() if value > 0}


def actor_options(ask: Mapping[str, float]) -> dict[str, object]:
    """``ask`` as Ray actor options (``num_cpus`` is 0 when the ask names no CPU)."""
    options: dict[str, object] = {"num_cpus": ask.get("CPU", 0)}
    if "GPU" in ask:
        options["num_gpus"] = ask["GPU"]
    if "memory" in ask:
        options["memory"] = ask["memory"]
    custom = {k: v for k, v in ask.items() if k not in BUILTIN_RESOURCES}
    if custom:
        options["resources"] = custom
    return options


def fits(ask: Mapping[str, float], resources: Mapping[str, float]) -> float:
    """How many workers asking ``ask`` a node with ``resources`` holds (``inf`` for an
    empty ask)."""
    counts = [math.floor(resources.get(k, 0.0) / v + 1e-9) for k, v in ask.items()]
    return min(counts) if counts else math.inf


def describe(resources: Mapping[str, float]) -> str:
    """``CPU 1, GPU 1`` (``nothing`` for an empty mapping)."""
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())) or "nothing"
