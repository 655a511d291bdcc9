"""Pipeline stages cut out of a user's whole model by ``torch.distributed.pipelining``.

`ModelSplit` is a ``build_stage`` callback (``(stage, num_stages) -> nn.Module``) made from
a function that builds the user's full model. Inside each worker it builds the model from
the job's seed -- so every replica of a stage starts bit-identical -- traces it with
``torch.distributed.pipelining.pipeline`` on one example microbatch, and keeps only its own
stage's module. The stage modules hold the model's own parameters under their original
names (``layers.3.attn.weight``), compute exactly what the unsplit model computes, and
pass on one tensor, or a tuple of tensors when several values cross a split point (GPT-2
passes its hidden states and its attention mask).

[Note: splitting a model]
- Where: explicit ``split_points`` (module paths; each starts a new stage,
  ``SplitPoint.BEGINNING``), or balanced ones: the model's blocks are the children of its
  longest ``nn.ModuleList`` / ``nn.Sequential``, the parameters registered before the
  blocks go with the first block (an embedding), those after with the last (a head), and
  the blocks are cut into contiguous runs minimising the largest run's parameter count.
- Shapes: the trace records the example microbatch's shapes (``torch.export`` without
  dynamic shapes), so every microbatch of the run -- training and held-out -- must have
  the example's shape and dtype; the first stage checks that and says so otherwise.
- What is refused, on the driver before any worker starts (`ModelSplit.check`): a model
  ``torch.export`` cannot trace (with the tracer's reason), a split point that names no
  module, more stages than blocks, a split that leaves a stage with no parameters, weights
  tied across stages (each stage's copy would train on its own and drift apart), and a
  last stage that returns anything but one tensor.
- Cost: each worker traces the model once when it builds its stage (about a second for a
  small transformer on a CPU core), a replacement worker too.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallelism.seeding import seed_everything

__all__ = ["ModelSplit", "balanced_split_points", "find_blocks"]


def find_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The model's repeated blocks: the path of its longest ``ModuleList`` / ``Sequential``
    (the shallowest of equally long ones) and the paths of that container's children.

    Raises:
        ValueError: if the model has no container of at least two modules.
    """
    best: tuple[int, int, str] | None = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.Sequential) and len(module) >= 2:
            key = (len(module), -path.count("."), path)
            if best is None or key[:2] > best[:2]:
                best = key
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks to split "
            "between; give split_points= (module paths that start a stage)"
        )
    path = best[2]
    container = model.get_submodule(path)
    prefix = f"{path}." if path else ""
    return path, [f"{prefix}{name}" for name, _ in container.named_children()]


def balanced_split_points(model: nn.Module, num_stages: int) -> list[str]:
    """Split points that cut the model's blocks into ``num_stages`` runs of balanced size.

    See [Note: splitting a model]: a run's size is its blocks' parameters, plus the
    parameters registered before the blocks for the first run and after them for the last.

    Raises:
        ValueError: if there are fewer blocks than stages (or no blocks).
    """
    container, blocks = find_blocks(model)
    if num_stages > len(blocks):
        raise ValueError(
            f"cannot cut {type(model).__name__} into {num_stages} stages: it has "
            f"{len(blocks)} blocks ({container or 'the model'}); use at most {len(blocks)} "
            "stages or give split_points="
        )
    if num_stages == 1:
        return []
    sizes = [0] * len(blocks)
    before = after = 0
    seen_block = False
    for name, param in model.named_parameters():
        index = next((i for i, b in enumerate(blocks) if name.startswith(f"{b}.")), None)
        if index is None:
            if seen_block:
                after += param.numel()
            else:
                before += param.numel()
        else:
            seen_block = True
            sizes[index] += param.numel()
    sizes[0] += before
    sizes[-1] += after
    starts = _min_max_partition(sizes, num_stages)
    return [blocks[i] for i in starts[1:]]


def _min_max_partition(sizes: Sequence[int], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous non-empty runs of ``sizes`` minimising the
    largest run's sum (the earliest cut among equally good ones)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: the smallest largest-run sum of sizes[:i] cut into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


@dataclass(frozen=True)
class ModelSplit:
    """A ``build_stage`` callback that cuts the user's whole model into pipeline stages.

    Picklable when ``make_model`` is (a module-level function, a class, a
    ``functools.partial``). See [Note: splitting a model].

    Raises:
        ValueError: for a non-callable ``make_model``, an ``example_input`` that is not a
            tensor, or bad ``split_points``.
    """

    make_model: Callable[[], nn.Module]
    """``() -> nn.Module``: the whole model, called with torch's RNG seeded from the job's
    seed (every worker builds the same initial weights)."""
    example_input: torch.Tensor
    """One microbatch of inputs, with the shape and dtype of every microbatch of the run."""
    split_points: tuple[str, ...] | None = None
    """Module paths, each the first module of a new stage; None: balanced ones."""
    seed: int = 0
    """The job's seed (`TrainSpec.seed`)."""

    def __post_init__(self) -> None:
        if not callable(self.make_model):
            raise ValueError(f"make_model must be callable, got {self.make_model!r}")
        if not isinstance(self.example_input, torch.Tensor):
            raise ValueError(
                f"example_input must be one microbatch of inputs as a tensor, got "
                f"{type(self.example_input).__name__}"
            )
        if self.split_points is not None:
            if isinstance(self.split_points, str) or not all(
                isinstance(p, str) and p for p in self.split_points
            ):
                raise ValueError(
                    f"split_points must be a list of module paths, got {self.split_points!r}"
                )
            if len(set(self.split_points)) != len(self.split_points):
                raise ValueError(f"split_points name a module twice: {list(self.split_points)}")

    # -- building ---------------------------------------------------------------------------

    def model(self) -> nn.Module:
        """The whole model with the job's initial weights."""
        seed_everything(self.seed, "model")
        model = self.make_model()
        if not isinstance(model, nn.Module):
            raise ValueError(f"make_model() returned {type(model).__name__}, not nn.Module")
        return model

    def points(self, model: nn.Module, num_stages: int) -> list[str]:
        """The split points for ``num_stages`` stages (checked against the model).

        Raises:
            ValueError: if a split point names no module, or their count does not give
                ``num_stages`` stages.
        """
        if self.split_points is None:
            return balanced_split_points(model, num_stages)
        for point in self.split_points:
            try:
                model.get_submodule(point)
            except AttributeError:
                _, blocks = _blocks_or_none(model)
                hint = f"; its blocks are {blocks[0]} ... {blocks[-1]}" if blocks else ""
                raise ValueError(
                    f"split point {point!r} names no module of {type(model).__name__}{hint}"
                ) from None
        if len(self.split_points) + 1 != num_stages:
            raise ValueError(
                f"{len(self.split_points)} split points make {len(self.split_points) + 1} "
                f"stages, but the job has {num_stages}"
            )
        return list(self.split_points)

    def stages(self, num_stages: int) -> tuple[nn.Module, list[nn.Module]]:
        """The whole model and its ``num_stages`` stage modules (sharing its parameters).

        Raises:
            ValueError: see [Note: splitting a model].
        """
        model = self.model()
        points = self.points(model, num_stages)
        if num_stages == 1:
            return model, [model]
        from torch.distributed.pipelining import SplitPoint, pipeline

        # The tracer prints the graph it gave up on; the error below says what matters.
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            try:
                pipe = pipeline(
                    model,
                    mb_args=(self.example_input,),
                    split_spec=dict.fromkeys(points, SplitPoint.BEGINNING),
                )
            except Exception as err:
                raise ValueError(
                    f"cannot split {type(model).__name__} at {points}: torch.export could not "
                    f"trace it. {_trace_failure(model, err)} Pipelining needs a model without "
                    "data-dependent control flow; see https://pytorch.org/docs/stable/export.html"
                ) from err
        if pipe.num_stages != num_stages:
            raise ValueError(
                f"splitting {type(model).__name__} at {points} gave {pipe.num_stages} stages, "
                f"not {num_stages}: a split leaves an empty stage (are the split points in "
                "the order the model runs them?)"
            )
        modules = [pipe.get_stage_module(s) for s in range(num_stages)]
        for module, carry in zip(modules, _carries(pipe.split_gm.graph), strict=True):
            _carry_through(module, carry)
        return model, modules

    def __call__(self, stage: int, num_stages: int) -> nn.Module:
        model, modules = self.stages(num_stages)
        module = modules[stage]
        if stage == 0:
            module.register_forward_pre_hook(_InputCheck(self.example_input))
        del model
        return module

    # -- validation on the driver -------------------------------------------------------------

    def check(self, num_stages: int) -> list[str]:
        """Split the model on the driver and check the stages; return the split points.

        Raises:
            ValueError: see [Note: splitting a model].
        """
        model, modules = self.stages(num_stages)
        points = self.points(model, num_stages)
        holders: dict[str, set[int]] = {}
        for s, module in enumerate(modules):
            names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
            if not names:
                raise ValueError(
                    f"stage {s} of {num_stages} (split points {points}) has no parameters; "
                    "move the split points so every stage holds some blocks"
                )
            for name in names:
                holders.setdefault(name, set()).add(s)
        tied: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(param), []).append(name)
        for names in tied.values():
            stages = sorted(set().union(*(holders.get(n, set()) for n in names)))
            if len(stages) > 1:
                raise ValueError(
                    f"weights tied across stages: {' = '.join(names)} are one parameter but "
                    f"land in stages {stages}; untie them (e.g. tie_word_embeddings=False) or "
                    "choose split points that keep them in one stage"
                )
        with torch.no_grad():
            value: Any = self.example_input
            for module in modules:
                value = module(*value) if isinstance(value, tuple) else module(value)
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"the model's last stage returns {type(value).__name__}; it must return one "
                "tensor, the loss function's input (wrap the model to pick its output, e.g. "
                "the logits)"
            )
        return points

    def check_microbatch(self, inputs: torch.Tensor, where: str) -> None:
        """Refuse a microbatch the traced stages cannot take (another shape or dtype)."""
        _InputCheck(self.example_input).check(inputs, where)


@dataclass(frozen=True)
class _Carry:
    """What one stage takes and gives in the pipeline's chain (node names of the split
    graph): ``takes`` arrive from the previous stage, ``args`` of them feed the stage's own
    module, whose outputs are ``gives`` (by index; ``None``: its whole result), and
    ``passes`` go on to the next stage -- its own outputs and earlier values that a later
    stage needs. The last stage passes on nothing but its module's result."""

    takes: tuple[str, ...]
    args: tuple[str, ...]
    gives: tuple[tuple[int | None, str], ...]
    passes: tuple[str, ...] | None


def _carries(graph: torch.fx.Graph) -> list[_Carry]:
    """Each stage's `_Carry`, read off the graph of ``pipeline``'s split model.

    A value one stage makes and a stage two or more further on uses (GPT-2's attention
    mask, made before the first block and used by every block) goes through the stages in
    between: this runtime sends activations to the next stage only.
    """
    nodes = list(graph.nodes)
    calls = [n for n in nodes if n.op == "call_module" and str(n.target).startswith("submod_")]
    stage_of = {call.name: s for s, call in enumerate(calls)}
    made_by: dict[str, int] = {n.name: -1 for n in nodes if n.op == "placeholder"}
    gives: list[list[tuple[int | None, str]]] = [[] for _ in calls]
    for n in nodes:
        if n.op == "call_module" and n.name in stage_of:
            if n.kwargs:
                raise ValueError(f"a split stage takes keyword arguments {list(n.kwargs)}")
            made_by[n.name] = stage_of[n.name]
        elif n.op == "call_function" and n.args and getattr(n.args[0], "name", None) in stage_of:
            owner = stage_of[n.args[0].name]
            made_by[n.name] = owner
            gives[owner].append((int(n.args[1]), n.name))
    used_by: dict[str, set[int]] = {}
    for call in calls:
        for arg in call.args:
            used_by.setdefault(arg.name, set()).add(stage_of[call.name])
    carries = []
    takes = tuple(n.name for n in nodes if n.op == "placeholder")
    for s, call in enumerate(calls):
        own = gives[s] or [(None, call.name)]
        passes = None
        if s < len(calls) - 1:
            passes = tuple(
                name
                for name, maker in made_by.items()
                if maker <= s and any(user > s for user in used_by.get(name, ()))
            )
        carries.append(
            _Carry(
                takes=takes,
                args=tuple(a.name for a in call.args),
                gives=tuple(own),
                passes=passes,
            )
        )
        takes = passes or ()
    return carries


def _carry_through(module: nn.Module, carry: _Carry) -> None:
    """Make a split stage module take and give its `_Carry` (its class becomes a subclass
    of the split's own, so its parameters keep their names)."""
    base = type(module)
    module.__class__ = type(f"Split{base.__name__}", (base,), {"forward": _carry_forward})
    module._split_forward = base.forward  # type: ignore[assignment]
    module._carry = carry  # type: ignore[assignment]


def _carry_forward(self: nn.Module, *values: Any) -> Any:
    carry: _Carry = self._carry  # type: ignore[assignment]
    if len(values) != len(carry.takes):
        raise ValueError(f"a split stage takes {len(carry.takes)} inputs, got {len(values)}")
    known = dict(zip(carry.takes, values, strict=True))
    out = self._split_forward(self, *(known[a] for a in carry.args))  # type: ignore[operator]
    if carry.passes is None:
        return out
    for index, name in carry.gives:
        known[name] = out if index is None else out[index]
    passed = tuple(known[name] for name in carry.passes)
    return passed[0] if len(passed) == 1 else passed


def _trace_failure(model: nn.Module, err: BaseException) -> str:
    """The tracer's reason, and where in the user's model it gave up: the module path(s)
    whose ``forward`` holds the failing line, and the line."""
    chain = [err]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(cause)
    innermost = chain[-1]
    reason = (str(innermost).strip().splitlines() or [repr(innermost)])[0]
    text = "\n".join(str(e) for e in chain)
    where = ""
    found = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)', text)
    if found:
        path, line, _, code = found[-1]
        modules = [
            name or type(model).__name__
            for name, module in model.named_modules()
            if _defines_line(type(module), path, int(line))
        ]
        place = f"in {', '.join(modules[:3])} " if modules else ""
        where = f" It failed {place}at {path}:{line}: {code.strip()}."
    return f"{type(innermost).__name__}: {reason}.{where}"


def _defines_line(cls: type, path: str, line: int) -> bool:
    forward = cls.__dict__.get("forward")
    if forward is None:
        return False
    try:
        lines, start = inspect.getsourcelines(forward)
        return os.path.samefile(inspect.getfile(forward), path) and start <= line < start + len(
            lines
        )
    except (OSError, TypeError):
        return False


def _blocks_or_none(model: nn.Module) -> tuple[str, list[str]]:
    try:
        return find_blocks(model)
    except ValueError:
        return "", []


class _InputCheck:
    """A forward pre-hook of the first stage: the input must look like the example."""

    def __init__(self, example: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(example.shape), example.dtype

    def check(self, x: object, where: str) -> None:
        if not isinstance(x, torch.Tensor) or (tuple(x.shape), x.dtype) != (
            self.shape,
            self.dtype,
        ):
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{where}: the split model was traced for microbatches of shape {self.shape} "
                f"{self.dtype}, got {got}; example_input must have the shape of every "
                "microbatch (training and held-out)"
            )

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.check(args[0] if args else None, "the first stage's input")
