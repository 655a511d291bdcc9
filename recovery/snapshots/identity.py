"""What a job is, as durable snapshots record it: a re-run in the same folder must match to resume.

`job_identity` describes each part of a `TrainSpec` -- the model, the optimizer, the data,
the held-out data, the schedule, the loss -- as a short text plus a digest of its full
description, deterministic across processes and machines (no object addresses, no
``id``, no hash-seeded order). See [Note: describing code]
A function is what it runs and what it runs with: its code object (the bytecode, its
constants -- nested functions' code included -- and the names it uses) and the values it
reads -- its defaults and keyword defaults, its closure cells, and the module globals its
code (or a nested function's) names, each described in turn. Line numbers, file names and
local variable names are left out: moving a function or renaming a local is the same job;
bytecode is the interpreter's own, so another Python minor version is another job. A
class is its name, its bases and the functions it defines. Code from the standard library
and installed packages (under a ``site-packages`` or the stdlib folder) is its qualified
name only: its version is the environment's business, and walking torch's code would cost
seconds. The walk through data stops at `_MAX_DEPTH` levels below each piece of code, and
at a cycle (a recursive function, a list that holds itself), marking the spot, so the same
objects always describe the same way. A function's text is
``module.qualname{<the values it reads that are data>}#<digest of it all>``: short to
read, complete to compare. A global that holds state built at run time (a timestamp, a
counter) makes every run another job: pass such a value as an argument instead.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import inspect
import io
import logging
import os
import site
import socket
import sys
import sysconfig
import threading
import types
from typing import Any

import numpy as np
import torch
import xxhash

from parallelism.spec import TrainSpec
from recovery.integrity.fingerprint import digest

__all__ = ["describe", "job_identity"]

_MACHINERY: tuple[type, ...] = (
    logging.Logger,
    logging.LoggerAdapter,
    logging.Handler,
    logging.Manager,
    io.IOBase,
    socket.socket,
    threading.Thread,
    threading.Event,
    threading.Condition,
    threading.Semaphore,
    type(threading.Lock()),
    type(threading.RLock()),
    concurrent.futures.Executor,
)
"""Objects that run a job rather than define it: a logger's level (``-v``), its handlers,
an open file, a lock or a thread differ between runs of the same job, so each is its type
(and name, if it has one) only."""
_MAX_DEPTH = 8
_SHOWN_ITEMS = 16
"""A longer list or dict shows this many items, then a count and a digest of them all."""
_SHOWN = 160


def describe(obj: Any) -> str:
    """A deterministic description of ``obj`` (see the module docstring and [Note:
    describing code]): equal for the same job in any process, different when a value the
    job depends on differs."""
    return _Walk().describe(obj, 0)


class _Walk:
    """One description: the objects on the current path (the cycle guard) and the code
    already described (so that a function several others call is walked once)."""

    def __init__(self) -> None:
        self.path: set[int] = set()
        self.memo: dict[int, str] = {}

    def describe(self, obj: Any, depth: int) -> str:
        if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
            return repr(obj)
        if isinstance(obj, np.generic):
            return f"{type(obj).__name__}({obj.item()!r})"
        if isinstance(obj, torch.Tensor):
            return _tensor(obj)
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
            return f"array{list(obj.shape)}:{obj.dtype}#{xxhash.xxh3_64(raw.data).hexdigest()}"
        if isinstance(obj, types.ModuleType):
            return f"module {obj.__name__}"
        if id(obj) in self.memo:
            return self.memo[id(obj)]
        if depth >= _MAX_DEPTH:
            return f"<deeper: {_name(type(obj))}>"
        if id(obj) in self.path:
            return f"<cycle: {_name(obj) if callable(obj) else _name(type(obj))}>"
        code = isinstance(obj, types.FunctionType | types.CodeType | type)
        self.path.add(id(obj))
        try:
            # Code starts the depth afresh, so that it reads the same wherever it is reached
            # (and is memoized once): the cycle guard and the memo bound the walk through code.
            text = self._composite(obj, 0 if code else depth + 1)
        finally:
            self.path.discard(id(obj))
        if code:
            self.memo[id(obj)] = text
        return text

    def _composite(self, obj: Any, d: int) -> str:
        if isinstance(obj, np.ndarray):  # of Python objects
            return f"array{list(obj.shape)}[{self.describe(obj.reshape(-1).tolist(), d)}]"
        if isinstance(obj, list | tuple | set | frozenset):
            items = [self.describe(v, d) for v in obj]
            if isinstance(obj, set | frozenset):  # by description, not by hash-seeded order
                items.sort()
            return "[" + _shorten(items) + "]"
        if isinstance(obj, dict):
            entries = sorted(
                f"{self.describe(k, d)}: {self.describe(v, d)}" for k, v in obj.items()
            )
            return "{" + _shorten(entries) + "}"
        if isinstance(obj, functools.partial):
            args = [self.describe(a, d) for a in obj.args]
            args += [f"{k}={self.describe(v, d)}" for k, v in sorted(obj.keywords.items())]
            return f"{self.describe(obj.func, d)}({', '.join(args)})"
        if isinstance(obj, types.CodeType):
            return self._code(obj, d)
        if isinstance(obj, types.FunctionType):
            return self._function(obj, d)
        if inspect.isclass(obj):
            return self._class(obj, d)
        if inspect.ismethod(obj):
            return f"{self.describe(obj.__self__, d)}.{self.describe(obj.__func__, d)}"
        if inspect.isroutine(obj):  # a builtin, a method descriptor: code that is not Python
            return _name(obj)
        if isinstance(obj, _MACHINERY):  # what runs the job, not what it computes
            return f"{_name(type(obj))}({getattr(obj, 'name', '')!r})"
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
        shown = ", ".join(f"{k}={self.describe(v, d)}" for k, v in sorted(public.items()))
        return f"{_name(type(obj))}({shown})"

    def _code(self, code: types.CodeType, d: int) -> str:
        consts = [self.describe(c, d) for c in code.co_consts]
        whole = (
            f"{code.co_argcount},{code.co_kwonlyargcount},{code.co_flags}:"
            f"{code.co_code.hex()}|{consts}|{code.co_names}"
        )
        return f"code#{_digest(whole.encode())}"

    def _function(self, fn: types.FunctionType, d: int) -> str:
        name = _name(fn)
        if _installed(fn.__code__.co_filename):
            return name
        code = fn.__code__
        read: list[tuple[str, Any]] = []
        positional = code.co_varnames[: code.co_argcount]
        defaults = fn.__defaults__ or ()
        read += zip(positional[len(positional) - len(defaults) :], defaults, strict=True)
        read += sorted((fn.__kwdefaults__ or {}).items())
        for cell_name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
            try:
                read.append((cell_name, cell.cell_contents))
            except ValueError:  # a cell not filled yet
                read.append((cell_name, "<empty cell>"))
        found = fn.__globals__
        read += [(g, found[g]) for g in sorted(_global_names(code)) if g in found]
        values = [(k, v, self.describe(v, d)) for k, v in read]
        whole = f"{self.describe(code, d)}; " + "; ".join(f"{k}={t}" for k, _, t in values)
        data = [f"{k}={t}" for k, v, t in values if not _is_code(v)]
        shown = "{" + _shorten(data) + "}" if data else ""
        return f"{name}{shown}#{_digest(whole.encode())}"

    def _class(self, cls: type, d: int) -> str:
        name = _name(cls)
        module = sys.modules.get(cls.__module__)
        where = getattr(module, "__file__", None)
        if cls.__module__ in sys.builtin_module_names or (where and _installed(where)):
            return name
        parts = [self.describe(base, d) for base in cls.__bases__]
        for key, value in sorted(vars(cls).items()):
            if isinstance(value, staticmethod | classmethod):
                value = value.__func__
            if isinstance(value, property):
                parts.append(f"{key}={self.describe([value.fget, value.fset, value.fdel], d)}")
            elif isinstance(value, types.FunctionType):
                parts.append(f"{key}={self.describe(value, d)}")
        return f"{name}#{_digest('; '.join(parts).encode())}"


def _is_code(value: Any) -> bool:
    return isinstance(value, types.ModuleType) or callable(value)


def _global_names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it use (globals among them; attribute
    names that happen to match a global are harmless)."""
    names = {n for n in code.co_names if not n.startswith("__")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(site.getsitepackages())
    return tuple(os.path.realpath(r) + os.sep for r in roots)


def _installed(filename: str) -> bool:
    """Whether code from ``filename`` belongs to the stdlib or an installed package (not to
    the job): frozen stdlib modules count, code compiled from a string does not."""
    if filename.startswith("<frozen"):
        return True
    if filename.startswith("<"):
        return False
    return os.path.realpath(filename).startswith(_installed_roots())


def _tensor(t: torch.Tensor) -> str:
    head = f"tensor{list(t.shape)}:{t.dtype}"
    if t.is_meta:
        return head + ":meta"
    return head + "#" + digest(t if t.layout == torch.strided else t.to_dense())


def _shorten(items: list[str]) -> str:
    """``items`` joined, or the first few, a count and a digest of them all."""
    if len(items) <= _SHOWN_ITEMS:
        return ", ".join(items)
    rest = len(items) - _SHOWN_ITEMS
    whole = _digest("\n".join(items).encode())
    return ", ".join(items[:_SHOWN_ITEMS]) + f", ...+{rest} more #{whole}"


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
