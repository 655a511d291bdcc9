"""CheckFree and CheckFree+ recovery math: rebuild a lost pipeline stage from its neighbours.

Everything here is a pure function on state dicts, tensors and small dataclasses -- no
processes, no Ray, no communication -- so the Ray runtime (on the states it gathers from
live workers) and the in-process convergence simulator (`simulations.convergence`) call
the very same code and produce the same rebuilt weights.

CheckFree (Blagoev, Ersoy, Chen, 2025; RESEARCH.md) rebuilds a lost intermediate stage
``i`` as ``W_i = (a * W_{i+1} + b * W_{i-1}) / (a + b)`` with ``a = |g_{i+1}| + eps`` and
``b = |g_{i-1}| + eps``, where ``|g_j|`` is the L2 norm of stage ``j``'s whole gradient in
the previous step, after the data-parallel all-reduce and after clipping (`GradNormTracker`,
`clip_stage_gradients`), and ``eps = 1e-4``. The rebuilt stage gets a fresh optimizer
(Adam moments zero) and a learning rate scaled by a constant (1.1). CheckFree+ also
rebuilds the first and last stages by copying their swap partner (`edge_copy`); see
[Note: CheckFree+ edge replicas] in `parallelism.workloads.llama`.

[Note: matching keys between stages]
Neighbouring stages need not look alike: they may hold different numbers of blocks, and
the edge stages (and CheckFree+'s replica holders) hold an embedding or a head that their
neighbours lack. Every rebuild therefore works key by key over the *template* -- the
state dict of a freshly initialised module of the lost stage, which fixes the keys,
shapes and dtypes of the result. For each template key:

- present (same shape) in both sources: combined (averaged, or taken from the chosen
  source for the copy strategies);
- present in one source only: taken from that source, unchanged;
- present in neither: the template's value (a fresh initialisation).

A source's keys that the template lacks are ignored. For LLaMA stages (blocks named
locally, [Note: stage-local block names]) this averages block ``k`` of one neighbour with
block ``k`` of the other, and it copies a CheckFree+ replica (the embedding on stage 1,
the head on stage ``S-2``) exactly from the only neighbour holding it. Keys listed as
``exact_keys`` (the CheckFree+ shared parameters) are always copied from the neighbour
holding them, whatever the averaging, so replicas stay bit-identical.

[Note: clipping the shared parameters]
Every stage clips its gradient to ``max_norm`` (1.0) after the all-reduce. With
CheckFree+ two stages hold each shared (embedding / head) parameter, and clipping it
with each holder's own stage norm would scale its (summed, equal) gradient by different
factors on the two holders and break the replica. So the shared parameters are clipped
as a group of their own, by their own norm -- the same number on both holders -- and the
stage's other parameters by theirs. The norm a stage records for CheckFree's weights is
the norm of its own gradient after clipping: its non-shared parameters, plus the shared
ones on their home stage (0 or ``S-1``), not on the replica holder.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from parallelism.checks import check_number, check_positive_int
from parallelism.engine import clip_gradients
from recovery.errors import RedundancyExhausted
from recovery.names import Strategy, StrEnum

StageState = dict[str, Tensor]
"""A stage module's ``state_dict``: parameter and buffer name -> tensor."""

MomentState = dict[str, dict[str, Tensor]]
"""Optimizer state by parameter name: name -> Adam's per-parameter state
(``step``, ``exp_avg``, ``exp_avg_sq``). A name absent means fresh (zero) state."""

DEFAULT_EPS = 1e-4
"""The constant the published weights add to each gradient norm."""


class Averaging(str, enum.Enum):
    """How a lost intermediate stage is rebuilt from its two neighbours.

    ``weighted`` is the published method; the others are the paper's ablations.
    """

    WEIGHTED = "weighted"
    """Gradient-norm-weighted average (CheckFree)."""
    UNIFORM = "uniform"
    """Plain mean of the two neighbours."""
    COPY = "copy"
    """Copy the neighbour with the larger gradient norm (the previous one on a tie)."""
    COPY_PREV = "copy_prev"
    """Copy stage ``i-1``."""
    COPY_NEXT = "copy_next"
    """Copy stage ``i+1``."""
    RANDOM = "random"
    """Re-initialise: the template's fresh weights."""


AveragingName = Literal["weighted", "uniform", "copy", "copy_prev", "copy_next", "random"]
"""An `Averaging` by its value."""
assert get_args(AveragingName) == tuple(a.value for a in Averaging), "AveragingName != Averaging"


class AblationMethod(StrEnum):
    """How an ablation rebuilt a stage, where no recovery `Strategy` names it (a
    `Rebuilt.method`; the published rebuilds are `Strategy.NEIGHBOR_AVERAGE` and
    `Strategy.EDGE_COPY`)."""

    COPY = "copy"
    """One neighbour copied whole (``Averaging.COPY``, ``COPY_PREV``, ``COPY_NEXT``)."""
    RANDOM = "random"
    """Re-initialised (``Averaging.RANDOM``)."""


@dataclass(frozen=True, kw_only=True)
class CheckFreeConfig:
    """The knobs of a CheckFree(+) rebuild; the defaults are the published method.

    Raises:
        ValueError: for an unknown ``averaging``, a non-positive or non-finite
            ``lr_scale`` or ``eps``, a negative ``rewarm_steps``, or an
            ``lr_scale_steps`` that is not ``None`` or a positive integer.
    """

    averaging: Averaging | AveragingName = Averaging.WEIGHTED
    """How an intermediate stage is rebuilt (an `Averaging`, or its value; stored as the
    `Averaging`)."""
    lr_scale: float = 1.1
    """Learning-rate multiplier of the rebuilt stage (1.1 for the paper's small and large
    models, 1.2 for the medium one)."""
    lr_scale_steps: int | None = None
    """For how many steps after the rebuild the scale applies; ``None``: until the stage is
    rebuilt again (the published method has no end)."""
    reset_optimizer: bool = True
    """``True`` (published): the rebuilt stage's Adam moments start from zero. ``False``:
    they are combined from the neighbours' moments with the same weights as the
    parameters (or copied, for the copy strategies)."""
    rewarm_steps: int = 0
    """Ramp the rebuilt stage's learning rate linearly up to its full (scaled) value over
    this many steps: step ``k`` after the rebuild uses ``(k + 1) / (rewarm_steps + 1)``
    of it. 0 (published): no ramp."""
    eps: float = DEFAULT_EPS
    """Added to each gradient norm in the weights."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "averaging", Averaging(self.averaging))
        except ValueError:
            known = ", ".join(a.value for a in Averaging)
            raise ValueError(
                f"CheckFreeConfig averaging must be one of {known}; got {self.averaging!r}"
            ) from None
        for name in ("lr_scale", "eps"):
            check_number(f"CheckFreeConfig {name}", getattr(self, name), positive=True)
        if (
            isinstance(self.rewarm_steps, bool)
            or not isinstance(self.rewarm_steps, int)
            or self.rewarm_steps < 0
        ):
            raise ValueError(
                f"CheckFreeConfig rewarm_steps must be a non-negative integer, "
                f"got {self.rewarm_steps!r}"
            )
        steps = self.lr_scale_steps
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ValueError(
                f"CheckFreeConfig lr_scale_steps must be None or a positive integer, got {steps!r}"
            )
        if not isinstance(self.reset_optimizer, bool):
            raise ValueError(
                f"CheckFreeConfig reset_optimizer must be a bool, got {self.reset_optimizer!r}"
            )

    def lr_factor(self, steps_since_rebuild: int) -> float:
        """Learning-rate multiplier of a rebuilt stage, ``steps_since_rebuild`` steps later.

        Step 0 is the first step after the rebuild. Combines ``lr_scale`` (while it applies,
        see ``lr_scale_steps``) with the ``rewarm_steps`` ramp.

        Raises:
            ValueError: if ``steps_since_rebuild`` is negative.
        """
        if steps_since_rebuild < 0:
            raise ValueError(f"steps_since_rebuild must be >= 0, got {steps_since_rebuild}")
        scaled = self.lr_scale_steps is None or steps_since_rebuild < self.lr_scale_steps
        factor = float(self.lr_scale) if scaled else 1.0
        if steps_since_rebuild < self.rewarm_steps:
            factor *= (steps_since_rebuild + 1) / (self.rewarm_steps + 1)
        return factor


@dataclass(frozen=True, kw_only=True)
class Rebuilt:
    """A rebuilt stage: its state and how it was made."""

    state: StageState
    """The rebuilt stage's state dict (same keys, shapes and dtypes as the template)."""
    method: Strategy | AblationMethod
    """`Strategy.NEIGHBOR_AVERAGE` or `Strategy.EDGE_COPY`; for an ablation, its
    `AblationMethod`."""
    weights: tuple[float, float]
    """Weights of (previous, next) neighbour, normalised to sum to 1; for an edge copy,
    ``(1, 0)`` on the partner's side."""
    moments: MomentState = field(default_factory=dict)
    """Optimizer state to start the rebuilt stage's optimizer from (by parameter name);
    empty: fresh. Always holds the shared (``exact_keys``) parameters' state when given."""


# ---- weights --------------------------------------------------------------------------------


def neighbor_weights(
    prev_norm: float | None,
    next_norm: float | None,
    averaging: Averaging | str = Averaging.WEIGHTED,
    *,
    eps: float = DEFAULT_EPS,
) -> tuple[float, float]:
    """Normalised weights ``(w_prev, w_next)`` of the two neighbours, summing to 1.

    ``weighted``: ``w_next = a / (a + b)``, ``w_prev = b / (a + b)`` with
    ``a = next_norm + eps`` and ``b = prev_norm + eps``; if either norm is ``None`` (no
    gradient yet) the weights are equal. ``uniform``: equal. ``copy``: all on the
    neighbour with the larger norm (the previous one on a tie or without norms);
    ``copy_prev`` / ``copy_next``: all on that one. ``random`` has no weights.

    Raises:
        ValueError: for ``random`` or an unknown averaging, or a negative or non-finite norm.
    """
    averaging = Averaging(averaging)
    for name, norm in (("prev_norm", prev_norm), ("next_norm", next_norm)):
        if norm is not None and not (math.isfinite(norm) and norm >= 0):
            raise ValueError(f"{name} must be a finite non-negative number or None, got {norm!r}")
    known = prev_norm is not None and next_norm is not None
    if averaging is Averaging.WEIGHTED:
        if not known:
            return 0.5, 0.5
        assert prev_norm is not None and next_norm is not None
        a, b = next_norm + eps, prev_norm + eps
        return b / (a + b), a / (a + b)
    if averaging is Averaging.UNIFORM:
        return 0.5, 0.5
    if averaging is Averaging.COPY:
        take_next = prev_norm is not None and next_norm is not None and next_norm > prev_norm
        return (0.0, 1.0) if take_next else (1.0, 0.0)
    if averaging is Averaging.COPY_PREV:
        return 1.0, 0.0
    if averaging is Averaging.COPY_NEXT:
        return 0.0, 1.0
    raise ValueError(f"averaging {averaging.value!r} has no neighbour weights")


# ---- state combination ------------------------------------------------------------------


def _matches(source: Mapping[str, Tensor] | None, key: str, like: Tensor) -> bool:
    return source is not None and key in source and source[key].shape == like.shape


def _blend(
    prev: Mapping[str, Tensor] | None,
    nxt: Mapping[str, Tensor] | None,
    template: Mapping[str, Tensor],
    prev_norm: float | None,
    next_norm: float | None,
    averaging: Averaging,
    eps: float,
    exact_keys: Collection[str],
) -> StageState:
    """Key-by-key rebuild over the template; see [Note: matching keys between stages]."""
    weighted = averaging is Averaging.WEIGHTED and prev_norm is not None and next_norm is not None
    if weighted:
        assert prev_norm is not None and next_norm is not None
        a, b = next_norm + eps, prev_norm + eps
    else:
        a = b = 1.0
    w_prev, w_next = (
        neighbor_weights(prev_norm, next_norm, averaging, eps=eps)
        if averaging is not Averaging.RANDOM
        else (0.0, 0.0)
    )
    out: StageState = {}
    for key, like in template.items():
        in_prev, in_next = _matches(prev, key, like), _matches(nxt, key, like)
        if in_prev and in_next and key not in exact_keys:
            assert prev is not None and nxt is not None
            p, n = prev[key], nxt[key]
            if averaging is Averaging.RANDOM:
                value = like
            elif not like.is_floating_point() or w_prev == 0.0 or w_next == 0.0:
                value = n if w_next > w_prev else p
            else:
                # The published formula, literally: (a * W_next + b * W_prev) / (a + b).
                value = (a * n.to(like.dtype) + b * p.to(like.dtype)) / (a + b)
        elif in_prev and (key in exact_keys or averaging is not Averaging.RANDOM):
            assert prev is not None
            value = prev[key]
        elif in_next and (key in exact_keys or averaging is not Averaging.RANDOM):
            assert nxt is not None
            value = nxt[key]
        else:
            if key in exact_keys:
                raise RedundancyExhausted(
                    f"shared key {key!r} is held by neither neighbour; the replica is lost "
                    "with its home stage -- roll back to a snapshot"
                )
            value = like
        out[key] = value.detach().to(dtype=like.dtype, device=like.device).clone()
    return out


def neighbor_average(
    prev: StageState | None,
    nxt: StageState | None,
    prev_norm: float | None,
    next_norm: float | None,
    *,
    template: StageState,
    eps: float = DEFAULT_EPS,
    exact_keys: Collection[str] = (),
) -> StageState:
    """CheckFree's rebuild: the gradient-norm-weighted average of the two neighbours.

    ``W = (a * W_next + b * W_prev) / (a + b)``, ``a = next_norm + eps``,
    ``b = prev_norm + eps``; with either norm ``None`` (no gradient yet), the plain mean.
    Keys are matched against ``template`` as [Note: matching keys between stages] says; a
    missing neighbour (``None``) contributes no keys, so the result copies the other one.

    Raises:
        ValueError: if both neighbours are ``None``, or a norm is negative or not finite.
        RedundancyExhausted: if a key in ``exact_keys`` is held by neither neighbour.
    """
    if prev is None and nxt is None:
        raise ValueError("neighbor_average needs at least one neighbour's state")
    neighbor_weights(prev_norm, next_norm, eps=eps)  # validates the norms
    return _blend(prev, nxt, template, prev_norm, next_norm, Averaging.WEIGHTED, eps, exact_keys)


def uniform_average(
    prev: StageState | None,
    nxt: StageState | None,
    *,
    template: StageState,
    exact_keys: Collection[str] = (),
) -> StageState:
    """The plain mean of the two neighbours (the published weights without norms).

    Raises:
        ValueError: if both neighbours are ``None``.
        RedundancyExhausted: if a key in ``exact_keys`` is held by neither neighbour.
    """
    if prev is None and nxt is None:
        raise ValueError("uniform_average needs at least one neighbour's state")
    return _blend(prev, nxt, template, None, None, Averaging.UNIFORM, DEFAULT_EPS, exact_keys)


def copy_neighbor(
    source: StageState,
    *,
    template: StageState,
    other: StageState | None = None,
    exact_keys: Collection[str] = (),
) -> StageState:
    """Copy ``source`` into the template's keys (the paper's "copy one neighbour" ablation).

    Template keys that ``source`` lacks come from ``other`` if it has them, else from the
    template.

    Raises:
        RedundancyExhausted: if a key in ``exact_keys`` is held by neither state.
    """
    return _blend(source, other, template, None, None, Averaging.COPY_PREV, DEFAULT_EPS, exact_keys)


def random_reinit(
    template: StageState,
    *,
    prev: StageState | None = None,
    nxt: StageState | None = None,
    exact_keys: Collection[str] = (),
) -> StageState:
    """The template's fresh initialisation (the paper's "random re-initialisation" ablation).

    Only the ``exact_keys`` (CheckFree+ shared parameters) are still copied from the
    neighbour that holds them, so that replicas stay identical.

    Raises:
        RedundancyExhausted: if a key in ``exact_keys`` is held by neither neighbour.
    """
    return _blend(prev, nxt, template, None, None, Averaging.RANDOM, DEFAULT_EPS, exact_keys)


def edge_copy(partner_state: StageState, template: StageState) -> StageState:
    """CheckFree+'s rebuild of the first or last stage: a copy of its swap partner.

    The partner (stage 1 for stage 0, stage ``S-2`` for ``S-1``) has acted in the edge
    position on every swapped microbatch, and holds the replica of the (de)embedding, so
    every template key it holds with the same shape is copied from it; keys it lacks
    (more blocks on the edge stage than on its partner) keep the template's fresh values.

    Raises:
        Nothing; a template key that the partner lacks is simply freshly initialised.
    """
    return _blend(partner_state, None, template, None, None, Averaging.COPY_PREV, DEFAULT_EPS, ())


# ---- dispatch -------------------------------------------------------------------------------


def rebuild_stage(
    config: CheckFreeConfig,
    *,
    stage: int,
    num_stages: int,
    template: StageState,
    prev: StageState | None,
    nxt: StageState | None,
    prev_norm: float | None = None,
    next_norm: float | None = None,
    edge_replicas: bool = False,
    exact_keys: Collection[str] = (),
    prev_moments: MomentState | None = None,
    next_moments: MomentState | None = None,
) -> Rebuilt:
    """Rebuild lost stage ``stage`` from its live neighbours as ``config`` says.

    An intermediate stage (``0 < stage < S-1``) is rebuilt by ``config.averaging`` from
    ``prev`` (stage ``stage-1``) and ``nxt`` (stage ``stage+1``), both of which must be
    alive. An edge stage is rebuilt only with ``edge_replicas`` (CheckFree+): stage 0 by
    `edge_copy` of stage 1 (passed as ``nxt``), stage ``S-1`` of stage ``S-2`` (passed as
    ``prev``); with ``averaging="random"`` it is re-initialised instead. ``exact_keys``
    (from ``parallelism.workloads.llama.edge_replica_keys``) are copied exactly from the neighbour
    that holds them.

    The returned ``moments`` say what the rebuilt stage's optimizer starts from: with
    ``reset_optimizer`` only the shared keys' state (copied from their other holder, so the
    replicas' updates stay identical), else also the neighbours' moments combined with the
    same weights as the parameters (``prev_moments`` / ``next_moments``, by parameter
    name; `optimizer_moments` gathers them).

    Raises:
        ValueError: if ``stage`` is outside ``0..num_stages-1`` or ``num_stages < 3``
            (there is no intermediate stage), or a norm is invalid.
        RedundancyExhausted: if a neighbour needed for the rebuild is lost (``None``): two
            adjacent lost stages, or an edge stage without CheckFree+; the caller must roll
            back to a snapshot.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 3:
        raise ValueError(f"CheckFree needs num_stages >= 3, got {num_stages!r}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage!r} outside 0..{num_stages - 1}")
    averaging = Averaging(config.averaging)
    edge = stage in (0, num_stages - 1)
    if edge:
        if not edge_replicas:
            raise RedundancyExhausted(
                f"CheckFree cannot rebuild edge stage {stage} of {num_stages}: it has only one "
                "neighbour. Enable CheckFree+ (swapped routes and edge replicas) or roll back "
                "to a snapshot"
            )
        partner, partner_moments = (nxt, next_moments) if stage == 0 else (prev, prev_moments)
        if partner is None:
            raise RedundancyExhausted(
                f"edge stage {stage} and its swap partner were lost together; roll back"
            )
        if averaging is Averaging.RANDOM:
            state = random_reinit(template, prev=partner, exact_keys=exact_keys)
            method: Strategy | AblationMethod = AblationMethod.RANDOM
        else:
            state = edge_copy(partner, template)
            method = Strategy.EDGE_COPY
        weights = (0.0, 1.0) if stage == 0 else (1.0, 0.0)
        if config.reset_optimizer or averaging is Averaging.RANDOM:
            moments = _moments_for(exact_keys, partner_moments, None, 1.0, 0.0, exact_keys)
        else:
            moments = _moments_for(template, partner_moments, None, 1.0, 0.0, exact_keys)
        return Rebuilt(state=state, method=method, weights=weights, moments=moments)
    if prev is None or nxt is None:
        lost = stage - 1 if prev is None else stage + 1
        raise RedundancyExhausted(
            f"CheckFree cannot rebuild stage {stage}: its neighbour {lost} is lost too "
            "(adjacent failures); roll back to a snapshot"
        )
    state = _blend(prev, nxt, template, prev_norm, next_norm, averaging, config.eps, exact_keys)
    if averaging is Averaging.RANDOM:
        weights = (0.0, 0.0)
        method = AblationMethod.RANDOM
    else:
        weights = neighbor_weights(prev_norm, next_norm, averaging, eps=config.eps)
        method = AblationMethod.COPY if 0.0 in weights else Strategy.NEIGHBOR_AVERAGE
    if config.reset_optimizer or averaging is Averaging.RANDOM:
        moment_keys: Iterable[str] = exact_keys
    else:
        moment_keys = template
    moments = _moments_for(moment_keys, prev_moments, next_moments, *weights, exact_keys)
    return Rebuilt(state=state, method=method, weights=weights, moments=moments)


# ---- optimizer state ------------------------------------------------------------------------


def _moments_for(
    keys: Iterable[str],
    prev: MomentState | None,
    nxt: MomentState | None,
    w_prev: float,
    w_next: float,
    exact_keys: Collection[str],
) -> MomentState:
    """Per-parameter optimizer state for ``keys``: combined where both sources have it.

    Tensors of the same shape are averaged with the weights (``step`` takes the larger
    count, so Adam's bias correction matches the moments' age); a key only one source
    has -- or a shared key, or a zero weight -- is copied from the source that has it (the
    heavier one if both); a key neither has is left out (fresh).
    """
    out: MomentState = {}
    for key in keys:
        p = prev.get(key) if prev is not None else None
        n = nxt.get(key) if nxt is not None else None
        if p is not None and n is not None and key not in exact_keys and w_prev and w_next:
            if p.keys() != n.keys() or any(
                p[f].shape != n[f].shape for f in p if isinstance(p[f], Tensor)
            ):
                out[key] = _clone_moment(n if w_next >= w_prev else p)
                continue
            merged: dict[str, Tensor] = {}
            for name, value in p.items():
                other = n[name]
                if name == "step":
                    merged[name] = torch.maximum(value, other).clone()
                else:
                    merged[name] = (w_prev * value + w_next * other).clone()
            out[key] = merged
        elif p is not None and (n is None or w_prev >= w_next or key in exact_keys):
            out[key] = _clone_moment(p)
        elif n is not None:
            out[key] = _clone_moment(n)
    return out


def _clone_moment(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}


def optimizer_moments(module: nn.Module, optimizer: torch.optim.Optimizer) -> MomentState:
    """The optimizer's per-parameter state of ``module``, keyed by parameter name (copied).

    Parameters with no state yet (never stepped) are absent.

    Raises:
        Nothing.
    """
    out: MomentState = {}
    for name, param in module.named_parameters():
        state = optimizer.state.get(param)
        if state:
            out[name] = _clone_moment(state)
    return out


def load_optimizer_moments(
    module: nn.Module, optimizer: torch.optim.Optimizer, moments: Mapping[str, Mapping[str, Tensor]]
) -> None:
    """Set the optimizer state of ``module``'s parameters from ``moments`` (by name).

    Parameters absent from ``moments`` get an empty (fresh) state.

    Raises:
        ValueError: if a name in ``moments`` is not a parameter of ``module``, or a
            moment's shape differs from its parameter's.
    """
    params = dict(module.named_parameters())
    unknown = sorted(set(moments) - set(params))
    if unknown:
        raise ValueError(f"optimizer moments for unknown parameters {unknown}")
    for name, param in params.items():
        optimizer.state.pop(param, None)
        state = moments.get(name)
        if state is None:
            continue
        for field_name, value in state.items():
            if field_name != "step" and isinstance(value, Tensor) and value.shape != param.shape:
                raise ValueError(
                    f"optimizer moment {name}.{field_name} has shape {list(value.shape)}, "
                    f"the parameter {list(param.shape)}"
                )
        optimizer.state[param] = {
            k: v.detach().clone().to(param.device) if isinstance(v, Tensor) else v
            for k, v in state.items()
        }


# ---- gradient-norm bookkeeping --------------------------------------------------------------


@dataclass
class GradNormTracker:
    """The last clipped gradient norm of every stage: what CheckFree's weights read.

    In the distributed runtime each worker keeps its own stage's entry (a float) and the
    recovery gathers the neighbours'; in-process one tracker holds them all. A stage that
    has not had a gradient since it was (re)built has ``None``.

    Raises:
        ValueError: if ``num_stages`` is not a positive integer, or a stage index is out of
            range, or a recorded norm is negative or not finite.
    """

    num_stages: int
    norms: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_positive_int("GradNormTracker num_stages", self.num_stages)
        if not self.norms:
            self.norms = [None] * self.num_stages
        if len(self.norms) != self.num_stages:
            raise ValueError(
                f"GradNormTracker got {len(self.norms)} norms for {self.num_stages} stages"
            )

    def _check(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside 0..{self.num_stages - 1}")

    def record(self, stage: int, norm: float) -> None:
        """Record ``stage``'s clipped gradient norm of the step just taken."""
        self._check(stage)
        if not (math.isfinite(norm) and norm >= 0):
            raise ValueError(f"gradient norm of stage {stage} must be finite and >= 0, got {norm}")
        self.norms[stage] = float(norm)

    def last(self, stage: int) -> float | None:
        """``stage``'s last recorded norm, or ``None`` if it has none."""
        self._check(stage)
        return self.norms[stage]

    def forget(self, stage: int) -> None:
        """Drop ``stage``'s norm (it was rebuilt; its gradient history is gone)."""
        self._check(stage)
        self.norms[stage] = None

    def neighbours(self, stage: int) -> tuple[float | None, float | None]:
        """The last norms of ``stage - 1`` and ``stage + 1`` (``None`` outside the pipeline)."""
        self._check(stage)
        prev = self.norms[stage - 1] if stage > 0 else None
        nxt = self.norms[stage + 1] if stage + 1 < self.num_stages else None
        return prev, nxt

    def copy(self) -> GradNormTracker:
        """An independent copy (for snapshots)."""
        return GradNormTracker(self.num_stages, list(self.norms))


def clip_stage_gradients(
    own: Sequence[nn.Parameter],
    shared: Sequence[nn.Parameter] = (),
    *,
    max_norm: float | None = 1.0,
    shared_is_home: bool = True,
) -> float:
    """Clip a stage's (all-reduced) gradient and return the norm CheckFree records for it.

    ``own`` are the stage's parameters except the CheckFree+ shared ones, ``shared`` the
    shared (embedding / head) parameters it holds, whose gradients must already be summed
    over both holders. Each group is clipped to ``max_norm`` by its own norm (see
    [Note: clipping the shared parameters]); the returned norm is that of ``own`` after
    clipping, combined with ``shared``'s when this stage is their home (0 or ``S-1``).
    Without shared parameters this is plain per-stage clipping.

    Raises:
        ValueError: if ``max_norm`` is not positive.
    """
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm must be positive or None, got {max_norm!r}")
    # One clipping arithmetic for the runtime, the reference and this simulator.
    return clip_gradients(own, max_norm, shared, shared_is_home=shared_is_home)[1]


def sum_shared_gradients(pairs: Iterable[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Sum the gradients of each pair of tied (replicated) parameters into both.

    The in-process equivalent of the two-rank all-reduce (SUM) the runtime runs over the
    holders of each CheckFree+ shared parameter. A missing gradient counts as zero.

    Raises:
        ValueError: if the two parameters of a pair differ in shape.
    """
    for a, b in pairs:
        if a.shape != b.shape:
            raise ValueError(f"tied parameters differ in shape: {list(a.shape)} vs {list(b.shape)}")
        if a.grad is None and b.grad is None:
            continue
        total = (
            a.grad + b.grad
            if a.grad is not None and b.grad is not None
            else (a.grad if a.grad is not None else b.grad)
        )
        assert total is not None
        a.grad = total.clone()
        b.grad = total.clone()
