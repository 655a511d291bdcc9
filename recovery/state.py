"""What one worker holds, declared once: `WorkerState`, and its `Progress`.

[Note: one worker state]
A worker's state is three parts, and nothing else:

- ``model``: its stage module's ``state_dict()``: the parameters and the persistent
  buffers (BatchNorm's running statistics and its counter, ...). Non-persistent buffers
  are not state: a module rebuilds them (a RoPE table, a causal mask).
- ``optimizer``: its optimizer's ``state_dict()``: moments, step counts, hyper-parameters.
- ``progress`` (`Progress`, a small wire record): the step -- the number of steps
  committed, which is also the data cursor and, with the job's seed, every random stream
  (``parallelism/seeding.py``), so no RNG bytes are state -- and the mark of a CheckFree
  rebuild (`Rebuild`: when, and the learning-rate scale the rebuilt stage trains with).

Every path that moves, stores or checks a worker's state walks this one declaration:

- a live transfer, same-host included (`recovery.transport`): `describe` is the header,
  `WorkerState.tensors` what follows it, `load` what the receiver applies;
- a peer snapshot (`recovery.snapshots.packing`): the same description, the same tensors
  packed into one buffer;
- a durable snapshot, a resume and a restart checkpoint (`recovery.snapshots.checkpoint`):
  `dcp_state` / `load_dcp_state`;
- a fingerprint and the replica vote (`recovery.integrity`): the same tensors by the
  same names, and a digest of the progress;
- the final states of `recovery.FitResult` (`WorkerState.to_cpu`).

So a field added to `Progress` travels, is stored and is checked everywhere at once, and
tests/test_worker_state.py sends a state with every field set through every path. A
rebuilt stage therefore stays one stage: a copy, a snapshot, a rollback or a resume
carries its learning-rate scale with its weights.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallelism.checks import check_index
from recovery.strategies.checkfree import CheckFreeConfig
from recovery.wire import decode, encode, record

__all__ = [
    "FIELDS",
    "Progress",
    "Rebuild",
    "WorkerState",
    "dcp_state",
    "describe_entry",
    "entry_from",
    "load_dcp_state",
    "state_to_cpu",
    "tensor_meta",
]


@record
@dataclass(frozen=True)
class Rebuild:
    """The mark a CheckFree(+) rebuild leaves on a stage: the step it was rebuilt at, and
    what its learning-rate scale is made of (`CheckFreeConfig.lr_factor`). Replicas of a
    rebuilt stage must hold the same mark, or they train at different rates and diverge.

    Raises:
        ValueError: for a negative step, or a scale `CheckFreeConfig` refuses.
    """

    step: int
    lr_scale: float
    lr_scale_steps: int | None
    rewarm_steps: int

    def __post_init__(self) -> None:
        check_index("Rebuild step", self.step)
        self.config  # noqa: B018 (validates the scale's parts)

    @classmethod
    def of(cls, config: CheckFreeConfig, step: int) -> Rebuild:
        """The mark of a rebuild made with ``config`` at ``step``."""
        return cls(step, float(config.lr_scale), config.lr_scale_steps, config.rewarm_steps)

    @functools.cached_property
    def config(self) -> CheckFreeConfig:
        """The rebuild's learning-rate knobs, as a `CheckFreeConfig` (its formula is used)."""
        return CheckFreeConfig(
            lr_scale=self.lr_scale,
            lr_scale_steps=self.lr_scale_steps,
            rewarm_steps=self.rewarm_steps,
        )

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier of the rebuilt stage at ``step``."""
        return self.config.lr_factor(max(0, step - self.step))


@record
@dataclass(frozen=True)
class Progress:
    """A worker's state besides its tensors (see [Note: one worker state]); every path
    carries it whole, as one wire record.

    Raises:
        ValueError: for a negative step or a rebuild that is not a `Rebuild`.
    """

    step: int = 0
    """Steps committed: the data cursor, and with the seed every random stream."""
    rebuild: Rebuild | None = None
    """The last CheckFree(+) rebuild of this stage, if any."""

    def __post_init__(self) -> None:
        check_index("Progress step", self.step)
        if self.rebuild is not None and not isinstance(self.rebuild, Rebuild):
            raise ValueError(f"Progress rebuild must be a Rebuild or None, got {self.rebuild!r}")

    def at(self, step: int) -> Progress:
        """The same progress at ``step``."""
        return dataclasses.replace(self, step=step)

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier of ``step`` (1 unless the stage was rebuilt)."""
        return 1.0 if self.rebuild is None else self.rebuild.lr_factor(step)

    def digest_bytes(self) -> bytes:
        """What a fingerprint hashes of the progress: its wire encoding."""
        return encode(self)

    def to_dict(self) -> dict[str, Any]:
        """The progress as plain values (what `FitResult.states` holds: they pickle, and
        ``torch.load(weights_only=True)`` loads them back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Progress:
        """The progress `to_dict` made ``values`` from.

        Raises:
            ValueError: for values that are not a progress's.
        """
        rebuild = values.get("rebuild")
        try:
            return cls(
                step=values["step"], rebuild=Rebuild(**rebuild) if rebuild is not None else None
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a worker's progress: {values!r} ({err})") from None


FIELDS: tuple[str, ...] = (
    "parameters",
    "buffers",
    "optimizer",
    *(f"progress.{f.name}" for f in dataclasses.fields(Progress)),
)
"""Every field of a worker's state, as tests/test_worker_state.py checks each path with."""


def tensor_meta(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    return ("tensor", tuple(t.shape), str(t.dtype).removeprefix("torch."))


def describe_entry(
    entry: dict[str, Any], tensors: list[torch.Tensor], names: list[str], prefix: str
) -> dict[str, Any]:
    """Describe one parameter's optimizer state; append the tensors that travel on their
    own to ``tensors`` and their names (``<prefix>.<key>``) to ``names``."""
    meta: dict[str, Any] = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            meta[key] = tensor_meta(value)
            tensors.append(value.detach())
            names.append(f"{prefix}.{key}")
        elif isinstance(value, torch.Tensor):
            # Scalars (Adam's step count) may live on the CPU even on a GPU worker, where
            # the backend cannot send them; they travel inside the description.
            meta[key] = ("scalar", value.detach().cpu().clone())
        else:
            meta[key] = ("value", value)
    return meta


def entry_from(
    meta: dict[str, Any], tensor: Any, targets: list[torch.Tensor] | None = None
) -> dict[str, Any]:
    """The receiving side of `describe_entry`: each travelling tensor from
    ``tensor(shape, dtype)`` (appended to ``targets``, in order), the values that travelled
    inside the description as they are."""
    entry: dict[str, Any] = {}
    for key, (kind, *rest) in meta.items():
        if kind == "tensor":
            entry[key] = tensor(*rest)
            if targets is not None:
                targets.append(entry[key])
        elif kind == "scalar":  # a copy: an optimizer steps its scalars in place
            entry[key] = torch.as_tensor(rest[0]).clone()
        else:
            entry[key] = rest[0]
    return entry


def _parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter at its index in ``optimizer.state_dict()``."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [names.get(id(p), str(i)) for i, p in enumerate(params)]


@dataclass(frozen=True)
class WorkerState:
    """One worker's state, by reference: its module, optimizer and progress (nothing is
    copied). See [Note: one worker state]."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    progress: Progress

    @property
    def step(self) -> int:
        return self.progress.step

    def describe(self) -> tuple[dict[str, Any], list[torch.Tensor], list[str]]:
        """The description of this state (JSON-able wire values), the tensors it lists in
        order, and their names: the module's ``state_dict`` keys, then
        ``optim.<parameter>.<key>`` (what fingerprints name them too)."""
        model = self.module.state_dict()
        opt = self.optimizer.state_dict()
        tensors: list[torch.Tensor] = [t.detach() for t in model.values()]
        names = list(model)
        params = _parameter_names(self.module, self.optimizer)
        state_meta: dict[int, dict[str, Any]] = {}
        for index, entry in opt["state"].items():
            where = params[index] if 0 <= index < len(params) else str(index)
            state_meta[index] = describe_entry(entry, tensors, names, f"optim.{where}")
        meta = {
            "model": [(k, *tensor_meta(v)[1:]) for k, v in model.items()],
            "optimizer": {"state": state_meta, "param_groups": opt["param_groups"]},
            "progress": self.progress,
        }
        return meta, tensors, names

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the state that travels on its own, named, in `describe`'s order."""
        _, tensors, names = self.describe()
        return list(zip(names, tensors, strict=True))

    def model_targets(self, meta: dict[str, Any]) -> list[torch.Tensor]:
        """The module's own tensors a description's model entries are received into (in
        place: a state_dict's tensors share storage with the module).

        Raises:
            ValueError: if the description is of another stage or model (names, shapes or
                dtypes differ), before anything is changed.
        """
        model = self.module.state_dict()
        expected = [
            (k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.items()
        ]
        got = [(str(k), tuple(shape), str(dtype)) for k, shape, dtype in meta["model"]]
        if expected != got:
            diff = next(
                (f"{e} vs {g}" for e, g in zip(expected, got, strict=False) if e != g),
                f"{len(expected)} tensors vs {len(got)}",
            )
            raise ValueError(f"the state does not match this module: first difference {diff}")
        return [model[k] for k, _, _ in expected]

    def check_groups(self, meta: dict[str, Any]) -> None:
        """Refuse a description whose optimizer has other parameter groups than ours.

        Raises:
            ValueError: naming the group sizes.
        """
        mine = [len(g["params"]) for g in self.optimizer.param_groups]
        theirs = [len(g["params"]) for g in meta["optimizer"]["param_groups"]]
        if mine != theirs:
            raise ValueError(
                f"the state's optimizer has parameter groups of sizes {theirs}, this "
                f"optimizer {mine}"
            )

    @staticmethod
    def optimizer_state(
        meta: dict[str, Any], tensor: Any, targets: list[torch.Tensor] | None = None
    ) -> dict[int, dict[str, Any]]:
        """The optimizer's per-parameter state a description lists: each travelling tensor
        from ``tensor(shape, dtype)`` (appended to ``targets``, in order), the rest from
        the description itself."""
        return {
            index: entry_from(entry, tensor, targets)
            for index, entry in meta["optimizer"]["state"].items()
        }

    def load(self, meta: dict[str, Any], optimizer_state: dict[int, dict[str, Any]]) -> Progress:
        """Apply a received description's optimizer state (its tensors already filled) and
        return its progress; the model's tensors were received in place."""
        self.optimizer.load_state_dict(
            {"state": optimizer_state, "param_groups": meta["optimizer"]["param_groups"]}
        )
        progress = meta["progress"]
        if not isinstance(progress, Progress):
            raise ValueError(f"a state description whose progress is {progress!r}")
        return progress

    def to_cpu(self) -> dict[str, Any]:
        """A copy of the whole state on the CPU: ``{"model", "optimizer", "progress"}``, the
        progress as plain values."""
        return state_to_cpu(self)


def state_to_cpu(state: WorkerState) -> dict[str, Any]:
    """`WorkerState.to_cpu`: the progress as plain values (`Progress.to_dict`), so that the
    whole copy pickles and ``torch.load(weights_only=True)`` loads it."""
    return {
        "model": {k: v.detach().cpu().clone() for k, v in state.module.state_dict().items()},
        "optimizer": _to_cpu(state.optimizer.state_dict()),
        "progress": state.progress.to_dict(),
    }


def _to_cpu(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def dcp_state(state: WorkerState) -> dict[str, Any]:
    """The state as torch.distributed.checkpoint saves and loads it: the model and the
    optimizer keyed by parameter name (the optimizer's state allocated even before its
    first step), and the progress as its wire encoding."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(state.module, state.optimizer)
    return {
        "model": model_state,
        "optim": optim_state,
        "progress": encode(state.progress).decode(),
    }


def load_dcp_state(state: WorkerState, loaded: dict[str, Any]) -> Progress:
    """Apply what DCP loaded into `dcp_state`'s dict (tensors in place) to ``state``'s
    module and optimizer; return the progress it holds.

    Raises:
        ValueError: if its progress is not one `dcp_state` wrote.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        state.module,
        state.optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optim"],
    )
    progress = decode(str(loaded["progress"]).encode())
    if not isinstance(progress, Progress):
        raise ValueError(f"a snapshot whose progress is {progress!r}")
    return progress
