"""What a job is, as durable snapshots record it: a re-run in the same folder must match to resume.

`job_identity` describes each part of a `TrainSpec` -- the model, the optimizer, the data,
the held-out data, the schedule, the loss -- as a short text plus a digest of its full
description, deterministic across processes and machines (no object addresses, no
``id``): functions and classes by qualified name, ``functools.partial`` by its function and
arguments, dataclasses and plain objects by their fields (``__getstate__`` where they
define one), tensors and arrays by shape, dtype and a hash of their first megabyte, an
object with a ``fingerprint`` attribute (a `TokenCorpus`: a hash of its tokens) by that;
private attributes are left out (caches, locks) unless an object has no public ones.
So re-running with another ``--lr``, ``--data`` or ``--dim`` is refused with a message
naming the part that differs, instead of silently resuming or failing deep inside a load.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from typing import Any

import numpy as np
import torch

from parallelism.spec import TrainSpec

__all__ = ["describe", "job_identity"]

_MAX_DEPTH = 6
_MAX_ITEMS = 64
_HASHED_BYTES = 1 << 20
_SHOWN = 160


def describe(obj: Any, depth: int = 0) -> str:
    """A deterministic description of ``obj`` (see the module docstring)."""
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return repr(obj)
    if depth >= _MAX_DEPTH:
        return _name(type(obj))
    d = depth + 1
    if isinstance(obj, torch.Tensor):
        head = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)[:_HASHED_BYTES]
        return f"tensor{list(obj.shape)}:{obj.dtype}#{_digest(head.numpy().tobytes())}"
    if isinstance(obj, np.ndarray):
        raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)[:_HASHED_BYTES]
        return f"array{list(obj.shape)}:{obj.dtype}#{_digest(raw.tobytes())}"
    if isinstance(obj, list | tuple | set | frozenset):
        items = sorted(obj, key=repr) if isinstance(obj, set | frozenset) else list(obj)
        listed = [describe(v, d) for v in items[:_MAX_ITEMS]]
        more = [f"...+{len(items) - _MAX_ITEMS}"] if len(items) > _MAX_ITEMS else []
        return "[" + ", ".join(listed + more) + "]"
    if isinstance(obj, dict):
        keys = sorted(obj, key=repr)[:_MAX_ITEMS]
        return "{" + ", ".join(f"{describe(k, d)}: {describe(obj[k], d)}" for k in keys) + "}"
    if isinstance(obj, functools.partial):
        args = [describe(a, d) for a in obj.args]
        args += [f"{k}={describe(v, d)}" for k, v in sorted(obj.keywords.items())]
        return f"{describe(obj.func, d)}({', '.join(args)})"
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
        return _name(obj)
    if inspect.ismethod(obj):
        return f"{describe(obj.__self__, d)}.{obj.__func__.__name__}"
    fingerprint = getattr(obj, "fingerprint", None)
    if isinstance(fingerprint, str):
        return f"{_name(type(obj))}(fingerprint={fingerprint})"
    if dataclasses.is_dataclass(obj):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    else:
        state = obj.__getstate__() if hasattr(obj, "__getstate__") else None
        fields = state if isinstance(state, dict) else dict(getattr(obj, "__dict__", {}))
    # Private attributes are caches and locks as often as not: the public ones say what it is.
    public = {k: v for k, v in fields.items() if not str(k).startswith("_")} or fields
    shown = ", ".join(f"{k}={describe(v, d)}" for k, v in sorted(public.items()))
    return f"{_name(type(obj))}({shown})"


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _entry(*parts: Any) -> str:
    full = "; ".join(describe(p) for p in parts)
    shown = full if len(full) <= _SHOWN else full[: _SHOWN - 3] + "..."
    return f"{shown} #{_digest(full.encode())}"


def job_identity(spec: TrainSpec) -> dict[str, str]:
    """Each part of ``spec`` as ``"<short description> #<digest of the full one>"``."""
    return {
        "model": _entry(spec.build_stage, spec.tables, spec.routes, spec.shared_params),
        "optimizer": _entry(spec.make_optimizer, spec.clip_grad_norm, spec.shard_optimizer),
        "data": _entry(spec.batches),
        "held_out_data": _entry(spec.val_batches),
        "schedule": _entry(spec.schedule, spec.lr_schedule),
        "loss": _entry(spec.loss_fn),
    }
