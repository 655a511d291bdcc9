"""Convergence under stage failures, in one process: the CheckFree study.

One pipeline replica of a LLaMA-style model -- all ``S`` stage modules in this process,
the paper's setting -- is trained on real text while a failure process kills stages, and
each recovery strategy is charged its modelled wall-clock cost. The result is validation
loss against *simulated* wall-clock time, from which `time_to_target` and the experiment
tables are computed. `scripts/experiment.py` runs the matrix from a TOML file.

[Note: convergence simulator model]
- Training: microbatches run one after another through the stages in their route order
  (natural, or CheckFree+'s swapped routes on odd microbatches); gradients accumulate,
  the CheckFree+ shared (embedding / head) gradients are summed over their two holders,
  every stage clips to ``clip_grad_norm`` and records its clipped norm
  (`recovery.strategies.clip_stage_gradients`), then AdamW steps with linear warmup.
- Time: every attempted step costs ``step_s`` of simulated time (``redundant_factor``
  times that for redundant computation). Evaluation is free.
- Failures: in attempt ``j`` (one per attempted step, counted across rollbacks) stage
  ``s`` fails iff ``u[j, s] < p`` with ``p = 1 - (1 - h) ** (t_step / 3600)``, ``h`` the
  hourly rate per stage and ``t_step`` the strategy's step time. ``u`` is a pure function
  of ``(seed, j)``: common random numbers, so every strategy sees the same draws for the
  same seed (a slower strategy, with a larger ``p``, fails on a superset of attempts).
  A failure abandons the attempted step (its time is lost) except under redundant
  computation, where the neighbour's copy finishes it.
- Recovery, per strategy:
  ``none``: failures are not drawn.
  ``checkfree``: a lost intermediate stage is rebuilt from its neighbours
  (`recovery.strategies.rebuild_stage`), costing ``recovery_s``; a lost edge stage, or two
  adjacent lost stages, cannot be rebuilt, and the job rolls back to its last checkpoint
  (``checkpoint_every``, saved at ``checkpoint_save_s`` each; without checkpoints, to the
  initial weights). The published CheckFree protects intermediate stages only; the
  rollback is our stated choice for the rest.
  ``checkfree+``: swapped routes and (de)embedding replicas; edge stages are rebuilt by
  `recovery.strategies.edge_copy` at ``recovery_s``. Adjacent lost stages roll back as
  above when ``checkpoint_every`` is set, else the stage that cannot be averaged is
  re-initialised (rare: it needs two neighbouring failures in one step).
  ``checkpoint``: every ``checkpoint_every`` steps a checkpoint is saved
  (``checkpoint_save_s``); a failure rolls every stage and optimizer back to it, costs
  ``checkpoint_reload_s``, and the steps since are redone.
  ``redundant``: no progress is lost; each failure costs ``failover_s``, and every step
  costs ``redundant_factor`` times as much.
- Exact strategies (``none``, ``checkpoint``, ``redundant``) never change *what* is
  trained, only *when*: a step re-run after a rollback uses the same data and the same
  arithmetic, so the weights after step ``k`` are bit-identical to a run without
  failures (tested). `run_convergence` can therefore take their losses from a
  no-failure ``baseline`` run and only replay the timeline, which makes the experiment
  matrix affordable; pass no baseline to train them literally.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from parallelism.workloads.data import LMBatches, TokenCorpus
from parallelism.workloads.llama import (
    LlamaConfig,
    LlamaStage,
    build_llama_stage,
    edge_partner,
    edge_replica_home,
    edge_replica_keys,
    llama_loss,
)
from parallelism.schedule import natural_routes, swapped_routes
from parallelism.seeding import seed_everything
from recovery.errors import RedundancyExhausted
from recovery.spec import linear_warmup
from recovery.strategies.checkfree import (
    CheckFreeConfig,
    GradNormTracker,
    clip_stage_gradients,
    load_optimizer_moments,
    optimizer_moments,
    rebuild_stage,
    sum_shared_gradients,
)

__all__ = [
    "KINDS",
    "ConvergenceExperiment",
    "ConvergenceSetup",
    "EvalRecord",
    "FailureEvent",
    "FailureProcess",
    "PipelineTrainer",
    "RunKey",
    "RunResult",
    "ScheduledFailures",
    "Strategy",
    "TimeModel",
    "auto_target",
    "display_rank",
    "exact_sensitivity",
    "run_convergence",
    "steps_to_loss",
    "summarize",
    "time_to_target",
]

KINDS = ("none", "checkfree", "checkfree+", "checkpoint", "redundant")
"""The strategy kinds; see [Note: convergence simulator model]."""


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner} {name} must be a positive integer, got {value!r}")


def _non_negative(owner: str, name: str, value: object, *, positive: bool = False) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > 0 if positive else value >= 0)
    )
    if not ok:
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(f"{owner} {name} must be {kind} number, got {value!r}")


# ---- configuration --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ConvergenceSetup:
    """The model, data and optimizer of one simulated training job.

    Raises:
        ValueError: for an unknown preset or override, a non-positive size, fewer than 3
            stages, an odd number of microbatches (CheckFree+ swaps every other one), or a
            bad learning-rate setting.
    """

    preset: str = "tiny"
    """`LlamaConfig` preset."""
    overrides: Mapping[str, int | float] = field(default_factory=dict)
    """`LlamaConfig` fields to change, e.g. ``{"dim": 128}``."""
    stages: int = 4
    """Pipeline stages S (CheckFree needs >= 3, CheckFree+ >= 4)."""
    microbatches: int = 4
    """Microbatches per step (even, so that half take the swapped route under CheckFree+)."""
    microbatch_size: int = 4
    """Sequences per microbatch."""
    seq_len: int | None = None
    """Tokens per sequence; ``None``: the preset's ``max_seq_len``."""
    lr: float = 3e-3
    """AdamW peak learning rate (betas 0.9 / 0.95)."""
    warmup_steps: int = 20
    """Linear warmup steps, then constant."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    clip_grad_norm: float = 1.0
    """Per-stage gradient clipping (the norm CheckFree's weights read is measured after it)."""
    eval_batches: int = 4
    """Validation microbatches per evaluation (the same ones every time)."""
    max_bytes: int = 4_000_000
    """Size of the default corpus (Python standard library sources, bytes)."""
    seed: int = 0
    """Seeds the initial weights and the data order (not the failures)."""
    threads: int | None = None
    """``torch.set_num_threads`` for the run; ``None``: leave it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", dict(self.overrides))
        self.model_config()  # validates preset and overrides
        for name in ("stages", "microbatches", "microbatch_size", "eval_batches", "max_bytes"):
            _positive_int("ConvergenceSetup", name, getattr(self, name))
        if self.stages < 3:
            raise ValueError(
                f"ConvergenceSetup stages must be >= 3 for CheckFree, got {self.stages}"
            )
        if self.microbatches % 2:
            raise ValueError(
                f"ConvergenceSetup microbatches must be even (CheckFree+ swaps every other "
                f"microbatch), got {self.microbatches}"
            )
        if self.seq_len is not None:
            _positive_int("ConvergenceSetup", "seq_len", self.seq_len)
            if self.seq_len > self.model_config().max_seq_len:
                raise ValueError(
                    f"ConvergenceSetup seq_len {self.seq_len} exceeds the model's max_seq_len "
                    f"{self.model_config().max_seq_len}"
                )
        _non_negative("ConvergenceSetup", "lr", self.lr, positive=True)
        _non_negative("ConvergenceSetup", "weight_decay", self.weight_decay)
        _non_negative("ConvergenceSetup", "clip_grad_norm", self.clip_grad_norm, positive=True)
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise ValueError(
                f"ConvergenceSetup warmup_steps must be an integer, got {self.warmup_steps!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(
                f"ConvergenceSetup seed must be a non-negative integer, got {self.seed!r}"
            )
        if self.threads is not None:
            _positive_int("ConvergenceSetup", "threads", self.threads)

    def model_config(self) -> LlamaConfig:
        """The `LlamaConfig` (byte-level vocabulary)."""
        return LlamaConfig.preset(self.preset, vocab_size=256, **self.overrides)

    def batches(self) -> LMBatches:
        """The deterministic data of this job."""
        config = self.model_config()
        return LMBatches(
            TokenCorpus.stdlib(max_bytes=self.max_bytes),
            seq_len=self.seq_len or config.max_seq_len,
            microbatch_size=self.microbatch_size,
            microbatches=self.microbatches,
            seed=self.seed,
        )

    def with_seed(self, seed: int) -> ConvergenceSetup:
        """The same job with another seed."""
        return ConvergenceSetup(**{**_fields(self), "seed": seed})


def _fields(obj: Any) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in obj.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class TimeModel:
    """Modelled wall-clock costs, in seconds (see [Note: convergence simulator model]).

    The defaults describe the paper's setting -- pipeline stages on cheap, unreliable,
    geo-distributed nodes -- rather than a datacenter: a step of a 124M-1.5B model whose
    activations cross the internet takes minutes, and a checkpoint of the model moves at
    internet bandwidth. They are stated assumptions; every one can be changed in the TOML.

    Raises:
        ValueError: if a cost is negative or not finite, ``step_s`` is not positive, or
            ``redundant_factor < 1``.
    """

    step_s: float = 120.0
    """One training step. 120 s gives the paper's O(10) failures per run at 5-16 % per
    stage-hour over a few hundred to a thousand steps with 4 stages."""
    recovery_s: float = 30.0
    """CheckFree(+) recovery: detect the loss, a replacement node joins, fetches its two
    neighbours' weights (or its partner's) and averages them."""
    checkpoint_save_s: float = 10.0
    """Saving one checkpoint to remote storage (stages upload their parts in parallel)."""
    checkpoint_reload_s: float = 120.0
    """Rollback: a replacement node joins and every stage downloads the checkpoint."""
    failover_s: float = 10.0
    """Redundant computation: the neighbour holding the copy takes over."""
    redundant_factor: float = 4.0 / 3.0
    """Step-time multiplier of redundant computation (Bamboo): each stage also runs its
    successor's forward pass; with backward = 2 x forward that is +1/3 of the compute,
    assumed not hidden in pipeline bubbles."""

    def __post_init__(self) -> None:
        _non_negative("TimeModel", "step_s", self.step_s, positive=True)
        for name in ("recovery_s", "checkpoint_save_s", "checkpoint_reload_s", "failover_s"):
            _non_negative("TimeModel", name, getattr(self, name))
        _non_negative("TimeModel", "redundant_factor", self.redundant_factor, positive=True)
        if self.redundant_factor < 1:
            raise ValueError(
                f"TimeModel redundant_factor must be >= 1, got {self.redundant_factor!r}"
            )

    def step_time(self, strategy: Strategy) -> float:
        """Seconds per attempted step under ``strategy``."""
        return self.step_s * (self.redundant_factor if strategy.kind == "redundant" else 1.0)


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A recovery strategy and its knobs. `Strategy.parse` reads ``"checkpoint:50"``.

    Raises:
        ValueError: for an unknown kind, a ``checkpoint`` without ``checkpoint_every``,
            a non-positive interval, or CheckFree knobs on a non-CheckFree kind.
    """

    kind: str
    """One of `KINDS`."""
    checkpoint_every: int | None = None
    """Checkpoint interval in steps: required for ``checkpoint``; for ``checkfree(+)`` the
    fallback for failures they cannot rebuild (``None``: no checkpoints)."""
    checkfree: CheckFreeConfig = field(default_factory=CheckFreeConfig)
    """Rebuild knobs of ``checkfree`` / ``checkfree+``."""
    label: str | None = None
    """Name in tables and plots; default from the kind and interval."""
    swap_every: int = 2
    """CheckFree+: microbatch ``m`` takes the swapped route iff ``m % swap_every ==
    swap_every - 1``; 2 (published) swaps every odd microbatch, 4 one in four."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown strategy kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.checkpoint_every is not None:
            _positive_int("Strategy", "checkpoint_every", self.checkpoint_every)
        if self.kind == "checkpoint" and self.checkpoint_every is None:
            raise ValueError("strategy 'checkpoint' needs checkpoint_every (e.g. 'checkpoint:50')")
        if self.kind in ("none", "redundant") and self.checkpoint_every is not None:
            raise ValueError(f"strategy {self.kind!r} takes no checkpoint_every")
        if not self.is_checkfree and self.checkfree != CheckFreeConfig():
            raise ValueError(f"CheckFree knobs given to strategy {self.kind!r}")
        _positive_int("Strategy", "swap_every", self.swap_every)
        if self.swap_every < 2:
            raise ValueError(f"Strategy swap_every must be >= 2, got {self.swap_every}")
        if self.kind != "checkfree+" and self.swap_every != 2:
            raise ValueError(f"swap_every is a CheckFree+ knob, given to {self.kind!r}")
        if not isinstance(self.checkfree, CheckFreeConfig):
            raise ValueError(
                f"Strategy checkfree must be a CheckFreeConfig, got {self.checkfree!r}"
            )

    @classmethod
    def parse(cls, text: str, **knobs: Any) -> Strategy:
        """``"none"``, ``"checkfree"``, ``"checkfree+"``, ``"checkpoint:50"``, ``"redundant"``,
        or a CheckFree kind with a fallback interval, ``"checkfree:100"``.

        ``knobs`` are `CheckFreeConfig` fields, plus ``label`` and ``swap_every``.

        Raises:
            ValueError: for an unknown kind, a bad interval or an unknown knob.
        """
        kind, _, every = text.strip().partition(":")
        interval: int | None = None
        if every:
            try:
                interval = int(every)
            except ValueError:
                raise ValueError(f"bad checkpoint interval in strategy {text!r}") from None
        label = knobs.pop("label", None)
        swap_every = int(knobs.pop("swap_every", 2))
        known = set(CheckFreeConfig.__dataclass_fields__)
        unknown = sorted(set(knobs) - known)
        if unknown:
            raise ValueError(f"unknown CheckFree knob(s) {unknown}; known: {sorted(known)}")
        return cls(
            kind=kind,
            checkpoint_every=interval,
            checkfree=CheckFreeConfig(**knobs),
            label=label,
            swap_every=swap_every,
        )

    @property
    def name(self) -> str:
        """``label``, or e.g. ``"checkpoint-50"``."""
        if self.label:
            return self.label
        if self.kind == "checkpoint":
            return f"checkpoint-{self.checkpoint_every}"
        return self.kind

    @property
    def is_checkfree(self) -> bool:
        """Whether this is ``checkfree`` or ``checkfree+``."""
        return self.kind in ("checkfree", "checkfree+")

    @property
    def plus(self) -> bool:
        """Whether this runs CheckFree+ (swapped routes, edge replicas)."""
        return self.kind == "checkfree+"

    @property
    def exact(self) -> bool:
        """Whether failures never change what is trained (only when): see the Note."""
        return self.kind in ("none", "checkpoint", "redundant")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description."""
        cf = asdict(self.checkfree)
        cf["averaging"] = str(getattr(self.checkfree.averaging, "value", self.checkfree.averaging))
        return {
            "name": self.name,
            "kind": self.kind,
            "checkpoint_every": self.checkpoint_every,
            "checkfree": cf if self.is_checkfree else None,
            "swap_every": self.swap_every,
        }


@dataclass(frozen=True, kw_only=True)
class FailureProcess:
    """Independent per-stage failures at an hourly rate, drawn with common random numbers.

    Raises:
        ValueError: if ``hourly_rate`` is outside [0, 1) or ``seed`` is negative.
    """

    hourly_rate: float
    """Probability that a given stage fails within an hour (0.05 = 5 % per stage-hour)."""
    seed: int = 0
    """Seeds the uniforms; the same seed gives every strategy the same draws."""

    def __post_init__(self) -> None:
        rate = self.hourly_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
            raise ValueError(f"FailureProcess hourly_rate must be in [0, 1), got {rate!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(
                f"FailureProcess seed must be a non-negative integer, got {self.seed!r}"
            )

    def probability(self, step_s: float) -> float:
        """Per-stage failure probability of one step of ``step_s`` seconds:
        ``1 - (1 - h) ** (step_s / 3600)``."""
        return 1.0 - (1.0 - self.hourly_rate) ** (step_s / 3600.0)

    def uniforms(self, attempt: int, num_stages: int) -> np.ndarray:
        """The ``num_stages`` uniforms of attempt ``attempt`` (a pure function of seed, attempt)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0xC4EC, attempt]))
        return rng.random(num_stages)

    def failed(self, attempt: int, num_stages: int, step_s: float) -> list[int]:
        """Stages that fail during attempt ``attempt`` of a step lasting ``step_s``."""
        p = self.probability(step_s)
        if p <= 0:
            return []
        return [int(s) for s in np.flatnonzero(self.uniforms(attempt, num_stages) < p)]


@dataclass(frozen=True, kw_only=True)
class ScheduledFailures:
    """Failures at fixed attempts: ``kills[attempt]`` = the stages lost in that attempt.

    Deterministic injection for tests and ablations; has `FailureProcess`'s interface.
    ``hourly_rate`` is only a label for results.

    Raises:
        ValueError: if an attempt is negative or a stage list is empty.
    """

    kills: Mapping[int, tuple[int, ...]]
    hourly_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        kills = {int(a): tuple(sorted(set(s))) for a, s in dict(self.kills).items()}
        for attempt, stages in kills.items():
            if attempt < 0 or not stages or min(stages) < 0:
                raise ValueError(f"bad scheduled failure at attempt {attempt}: stages {stages}")
        object.__setattr__(self, "kills", kills)

    def probability(self, step_s: float) -> float:
        """Not a rate: 0 (reported in results only)."""
        return 0.0

    def failed(self, attempt: int, num_stages: int, step_s: float) -> list[int]:
        """The stages scheduled to fail in ``attempt``.

        Raises:
            ValueError: if a scheduled stage is outside ``0..num_stages-1``.
        """
        stages = list(self.kills.get(attempt, ()))
        if stages and max(stages) >= num_stages:
            raise ValueError(f"scheduled failure of stage {max(stages)} with {num_stages} stages")
        return stages


FailureSource = FailureProcess | ScheduledFailures
"""Anything `run_convergence` draws failures from."""


# ---- the in-process pipeline ----------------------------------------------------------------


class PipelineTrainer:
    """All stages of one pipeline replica in this process, trained microbatch by microbatch.

    Args:
        setup: model, data and optimizer.
        plus: CheckFree+ -- swapped routes and (de)embedding replicas.
        batches: the data (default ``setup.batches()``; pass one to share the corpus).
        swap_every: with ``plus``, microbatch ``m`` is swapped iff ``m % swap_every ==
            swap_every - 1`` (2: every odd one, as published).

    The modules are built as `recovery.spec.TrainSpec` builds them (torch seeded from
    ``(seed, "init", stage)``), so stage ``s`` starts with the same weights here as in the
    distributed runtime.

    Raises:
        ValueError: if ``plus`` is asked for with fewer than 4 stages.
    """

    def __init__(
        self,
        setup: ConvergenceSetup,
        *,
        plus: bool = False,
        batches: LMBatches | None = None,
        swap_every: int = 2,
    ) -> None:
        S = setup.stages
        if plus and S < 4:
            raise ValueError(f"CheckFree+ needs at least 4 stages, got {S}")
        self.setup = setup
        self.plus = plus
        self.config = setup.model_config()
        self.batches = batches if batches is not None else setup.batches()
        self.routes = natural_routes(S, setup.microbatches)
        if plus:
            swapped = swapped_routes(S, setup.microbatches)
            # swapped_routes swaps the odd microbatches; swap_every > 2 keeps fewer of them.
            self.routes = tuple(
                swapped[1] if m % swap_every == swap_every - 1 else route
                for m, route in enumerate(self.routes)
            )
        self.modules: list[LlamaStage] = [self._build(s, ("init", s)) for s in range(S)]
        self.optimizers = [self._make_optimizer(s) for s in range(S)]
        self.tracker = GradNormTracker(S)
        self.rebuilt_at: list[int | None] = [None] * S
        """Step at which each stage was last rebuilt (``None``: never)."""
        self.stage_configs: list[CheckFreeConfig | None] = [None] * S
        """The config each rebuilt stage's learning-rate factor follows."""

    # -- construction ----------------------------------------------------------------------

    def _build(self, stage: int, key: tuple[str | int, ...]) -> LlamaStage:
        seed_everything(self.setup.seed, *key)
        return build_llama_stage(
            self.config,
            stage,
            self.setup.stages,
            edge_replicas=self.plus,
            replica_seed=self.setup.seed,
        )

    def shared_keys(self, stage: int) -> list[str]:
        """The CheckFree+ shared parameter names of ``stage`` (empty without CheckFree+)."""
        return edge_replica_keys(stage, self.setup.stages) if self.plus else []

    def _make_optimizer(self, stage: int) -> torch.optim.Optimizer:
        shared = set(self.shared_keys(stage))
        named = list(self.modules[stage].named_parameters())
        groups: list[dict[str, Any]] = [
            {"params": [p for n, p in named if n not in shared], "shared": False}
        ]
        if shared:
            groups.append({"params": [p for n, p in named if n in shared], "shared": True})
        return torch.optim.AdamW(
            groups,
            lr=self.setup.lr,
            betas=(0.9, 0.95),
            weight_decay=self.setup.weight_decay,
        )

    # -- training --------------------------------------------------------------------------

    def forward_route(self, inputs: torch.Tensor, route: Sequence[int]) -> torch.Tensor:
        """Run ``inputs`` through the stages in ``route`` order; the logits of the last."""
        x = inputs
        last = len(route) - 1
        for position, stage in enumerate(route):
            x = self.modules[stage](x, first=position == 0, last=position == last)
        return x

    def train_step(self, step: int) -> float:
        """One optimizer step on step ``step``'s data; returns the mean training loss."""
        S, M = self.setup.stages, self.setup.microbatches
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(M):
            inputs, targets = self.batches.microbatch(step, 0, m)
            loss = llama_loss(self.forward_route(inputs, self.routes[m]), targets)
            (loss / M).backward()
            total += float(loss.detach())
        if self.plus:
            sum_shared_gradients(self._tied_pairs())
        for s in range(S):
            shared = set(self.shared_keys(s))
            named = list(self.modules[s].named_parameters())
            norm = clip_stage_gradients(
                [p for n, p in named if n not in shared],
                [p for n, p in named if n in shared],
                max_norm=self.setup.clip_grad_norm,
                shared_is_home=edge_replica_home(s, S) if self.plus else True,
            )
            self.tracker.record(s, norm)
            self._set_lr(s, step)
            self.optimizers[s].step()
        return total / M

    def _tied_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        S = self.setup.stages
        pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for home in (0, S - 1):
            partner = edge_partner(home, S)
            assert partner is not None
            a = dict(self.modules[home].named_parameters())
            b = dict(self.modules[partner].named_parameters())
            pairs.extend((a[k], b[k]) for k in edge_replica_keys(home, S))
        return pairs

    def _set_lr(self, stage: int, step: int) -> None:
        base = self.setup.lr * linear_warmup(step, warmup_steps=self.setup.warmup_steps)
        rebuilt, cfg = self.rebuilt_at[stage], self.stage_configs[stage]
        factor = 1.0 if rebuilt is None or cfg is None else cfg.lr_factor(max(0, step - rebuilt))
        for group in self.optimizers[stage].param_groups:
            # Shared parameters keep the unscaled rate on both holders (they must stay equal).
            group["lr"] = base if group.get("shared") else base * factor

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` fixed held-out microbatches (natural route)."""
        route = tuple(range(self.setup.stages))
        losses = []
        mb = self.setup.microbatches
        for index in range(self.setup.eval_batches):
            inputs, targets = self.batches.microbatch(index // mb, 0, index % mb, split="val")
            losses.append(float(llama_loss(self.forward_route(inputs, route), targets)))
        return sum(losses) / len(losses)

    # -- state -----------------------------------------------------------------------------

    def states(self) -> list[dict[str, torch.Tensor]]:
        """A copy of every stage's state dict."""
        return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in self.modules]

    def snapshot(self) -> dict[str, Any]:
        """Everything a rollback restores: weights, optimizer states, norms, rebuild marks."""
        return {
            "states": self.states(),
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            "tracker": self.tracker.copy(),
            "rebuilt_at": list(self.rebuilt_at),
            "stage_configs": list(self.stage_configs),
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Roll every stage back to ``snapshot`` (from `snapshot`)."""
        for s, module in enumerate(self.modules):
            module.load_state_dict(snapshot["states"][s])
            self.optimizers[s] = self._make_optimizer(s)
            self.optimizers[s].load_state_dict(copy.deepcopy(snapshot["optimizers"][s]))
        self.tracker = snapshot["tracker"].copy()
        self.rebuilt_at = list(snapshot["rebuilt_at"])
        self.stage_configs = list(snapshot["stage_configs"])

    def rebuild(
        self, lost: Sequence[int], config: CheckFreeConfig, *, step: int, attempt: int
    ) -> list[str]:
        """Rebuild the ``lost`` stages from their live neighbours (CheckFree / CheckFree+).

        Every lost stage is rebuilt from the states the survivors hold now; their
        optimizers restart as ``config`` says and their learning-rate factor restarts at
        ``step``. Returns the method used per stage.

        Raises:
            RedundancyExhausted: if some lost stage cannot be rebuilt (an edge stage without
                CheckFree+, or a lost neighbour); nothing has been changed then.
        """
        S = self.setup.stages
        lost_set = set(lost)
        plans = []
        for s in sorted(lost_set):
            prev = s - 1 if s > 0 and s - 1 not in lost_set else None
            nxt = s + 1 if s + 1 < S and s + 1 not in lost_set else None
            template = self._build(s, ("rebuild", s, attempt)).state_dict()
            prev_norm, next_norm = self.tracker.neighbours(s)
            need_moments = not config.reset_optimizer or self.plus
            rebuilt = rebuild_stage(
                config,
                stage=s,
                num_stages=S,
                template=template,
                prev=self.modules[prev].state_dict() if prev is not None else None,
                nxt=self.modules[nxt].state_dict() if nxt is not None else None,
                prev_norm=prev_norm if prev is not None else None,
                next_norm=next_norm if nxt is not None else None,
                edge_replicas=self.plus,
                exact_keys=self.shared_keys(s),
                prev_moments=self._moments(prev) if need_moments and prev is not None else None,
                next_moments=self._moments(nxt) if need_moments and nxt is not None else None,
            )
            plans.append((s, rebuilt))
        for s, rebuilt in plans:
            self.modules[s].load_state_dict(rebuilt.state)
            self.optimizers[s] = self._make_optimizer(s)
            load_optimizer_moments(self.modules[s], self.optimizers[s], rebuilt.moments)
            self.tracker.forget(s)
            self.rebuilt_at[s] = step
            self.stage_configs[s] = config
        return [rebuilt.method for _, rebuilt in plans]

    def _moments(self, stage: int) -> dict[str, dict[str, torch.Tensor]]:
        return optimizer_moments(self.modules[stage], self.optimizers[stage])

    def reinit(self, stage: int, *, attempt: int, partner_lost: bool = False) -> None:
        """Re-initialise ``stage`` (the last resort when it cannot be rebuilt and there is no
        checkpoint). CheckFree+ shared parameters are copied, with their optimizer state,
        from their other holder unless that one is lost too (``partner_lost``); then both
        holders draw them fresh from the same replica seed and stay equal."""
        S = self.setup.stages
        fresh = self._build(stage, ("rebuild", stage, attempt)).state_dict()
        partner = edge_partner(stage, S) if self.plus else None
        copy_shared = partner is not None and not partner_lost
        if copy_shared:
            assert partner is not None
            live = self.modules[partner].state_dict()
            for key in self.shared_keys(stage):
                fresh[key] = live[key].clone()
        self.modules[stage].load_state_dict(fresh)
        self.optimizers[stage] = self._make_optimizer(stage)
        if copy_shared:
            assert partner is not None
            moments = self._moments(partner)
            load_optimizer_moments(
                self.modules[stage],
                self.optimizers[stage],
                {k: moments[k] for k in self.shared_keys(stage) if k in moments},
            )
        self.tracker.forget(stage)
        self.rebuilt_at[stage] = None
        self.stage_configs[stage] = None


# ---- results --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """A validation loss at a committed step and a simulated time."""

    step: int
    time_s: float
    val_loss: float


@dataclass(frozen=True, kw_only=True)
class FailureEvent:
    """One attempted step in which stages failed, and what the strategy did."""

    attempt: int
    step: int
    """The step that was being attempted."""
    time_s: float
    """Simulated time at which the failure was handled."""
    stages: tuple[int, ...]
    action: str
    """``"neighbor_average"``, ``"edge_copy"``, ``"copy"``, ``"random"``, ``"reinit"``,
    ``"rollback"`` or ``"failover"`` (several, comma-separated, for several stages)."""
    lost_steps: int
    """Committed steps undone (rollback), else 0."""
    seconds: float
    """Recovery cost charged, excluding the abandoned step."""


@dataclass(kw_only=True)
class RunResult:
    """One strategy's run: validation loss against simulated time, and its failures."""

    strategy: str
    rate: float
    seed: int
    steps: int
    step_s: float
    records: list[EvalRecord] = field(default_factory=list)
    events: list[FailureEvent] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    """Training loss per committed step of the final pass (exact replays: empty)."""
    total_time_s: float = 0.0
    attempts: int = 0
    derived: bool = False
    """True if the losses were taken from a no-failure baseline (see the Note)."""
    info: dict[str, Any] = field(default_factory=dict)

    def time_to(self, target: float) -> float | None:
        """`time_to_target` of this run."""
        return time_to_target(self.records, target)

    def final_loss(self) -> float:
        """The last recorded validation loss."""
        return self.records[-1].val_loss

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (`from_dict` reads it back)."""
        out = asdict(self)
        for event in out["events"]:
            event["stages"] = list(event["stages"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        """Read `to_dict`'s output."""
        data = dict(data)
        data["records"] = [EvalRecord(**r) for r in data.get("records", [])]
        data["events"] = [
            FailureEvent(**{**e, "stages": tuple(e["stages"])}) for e in data.get("events", [])
        ]
        return cls(**data)

    def dumps(self) -> str:
        """JSON text."""
        return json.dumps(self.to_dict())


def time_to_target(records: Sequence[EvalRecord], target: float) -> float | None:
    """Simulated time at which validation loss first reaches ``target``, or ``None``.

    Linear interpolation between the record just above the target and the first one at or
    below it (records in time order).
    """
    prev: EvalRecord | None = None
    for record in records:
        if record.val_loss <= target:
            if prev is None or prev.val_loss <= record.val_loss:
                return record.time_s
            frac = (prev.val_loss - target) / (prev.val_loss - record.val_loss)
            return prev.time_s + frac * (record.time_s - prev.time_s)
        prev = record
    return None


def auto_target(baseline: RunResult, fraction: float = 0.8) -> float:
    """The validation loss the no-failure ``baseline`` reaches at ``fraction`` of its steps.

    Taken at the last evaluation at or before that step.

    Raises:
        ValueError: if ``fraction`` is not in (0, 1] or the baseline has no records.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"target fraction must be in (0, 1], got {fraction!r}")
    if not baseline.records:
        raise ValueError("the baseline run has no evaluation records")
    limit = fraction * baseline.steps
    eligible = [r for r in baseline.records if r.step <= limit + 1e-9]
    return (eligible or baseline.records[:1])[-1].val_loss


# ---- the failure-and-recovery loop ------------------------------------------------------------


class _Executor(Protocol):
    def train(self, step: int) -> float | None: ...
    def evaluate(self, step: int) -> float: ...
    def snapshot(self) -> Any: ...
    def restore(self, snapshot: Any) -> None: ...
    def rebuild(self, lost: Sequence[int], step: int, attempt: int) -> list[str]: ...
    def reinit(self, stage: int, attempt: int, partner_lost: bool) -> None: ...


class _Live:
    """Executes the loop's decisions on a real `PipelineTrainer`."""

    def __init__(self, trainer: PipelineTrainer, config: CheckFreeConfig) -> None:
        self.trainer = trainer
        self.config = config

    def train(self, step: int) -> float | None:
        return self.trainer.train_step(step)

    def evaluate(self, step: int) -> float:
        return self.trainer.evaluate()

    def snapshot(self) -> Any:
        return self.trainer.snapshot()

    def restore(self, snapshot: Any) -> None:
        self.trainer.restore(snapshot)

    def rebuild(self, lost: Sequence[int], step: int, attempt: int) -> list[str]:
        return self.trainer.rebuild(lost, self.config, step=step, attempt=attempt)

    def reinit(self, stage: int, attempt: int, partner_lost: bool) -> None:
        self.trainer.reinit(stage, attempt=attempt, partner_lost=partner_lost)


class _Replay:
    """Replays an exact strategy on a no-failure baseline: the loss at step k is the
    baseline's (see [Note: convergence simulator model])."""

    def __init__(self, baseline: RunResult) -> None:
        self.losses = {r.step: r.val_loss for r in baseline.records}

    def train(self, step: int) -> float | None:
        return None

    def evaluate(self, step: int) -> float:
        if step not in self.losses:
            raise ValueError(
                f"the baseline run has no evaluation at step {step}; run it with the same "
                "steps and eval_every"
            )
        return self.losses[step]

    def snapshot(self) -> Any:
        return None

    def restore(self, snapshot: Any) -> None:
        return None

    def rebuild(self, lost: Sequence[int], step: int, attempt: int) -> list[str]:
        raise AssertionError("exact strategies never rebuild")

    def reinit(self, stage: int, attempt: int, partner_lost: bool) -> None:
        raise AssertionError("exact strategies never re-initialise")


def run_convergence(
    setup: ConvergenceSetup,
    strategy: Strategy,
    failures: FailureSource,
    times: TimeModel,
    *,
    steps: int,
    eval_every: int = 25,
    baseline: RunResult | None = None,
    progress: Callable[[int], None] | None = None,
    max_attempts: int | None = None,
) -> RunResult:
    """Train under ``failures`` with ``strategy`` for ``steps`` committed steps.

    See [Note: convergence simulator model]. Validation loss is recorded at step 0 and
    every ``eval_every`` committed steps (and at the end), with the simulated time.
    ``baseline`` (a ``none`` run of the same setup, steps and eval_every) lets an exact
    strategy replay the timeline without training. ``progress(step)`` is called after each
    committed step.

    Raises:
        ValueError: for a non-positive ``steps`` / ``eval_every``, a ``checkfree+`` run with
            fewer than 4 stages, or a baseline that does not match.

    A run that has not finished after ``max_attempts`` attempted steps (default
    ``20 * steps``) -- failures outpace progress, e.g. rollbacks every few steps -- stops
    there with ``info["finished"] = False``; its loss may never reach a target.
    """
    _positive_int("run_convergence", "steps", steps)
    _positive_int("run_convergence", "eval_every", eval_every)
    max_attempts = 20 * steps if max_attempts is None else max_attempts
    threads = torch.get_num_threads()
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)
    try:
        executor: _Executor
        derived = baseline is not None and strategy.exact
        if derived:
            assert baseline is not None
            if baseline.steps != steps or baseline.strategy != "none":
                raise ValueError(
                    f"baseline must be a 'none' run of {steps} steps, got "
                    f"{baseline.strategy!r} with {baseline.steps}"
                )
            executor = _Replay(baseline)
        else:
            trainer = PipelineTrainer(setup, plus=strategy.plus, swap_every=strategy.swap_every)
            executor = _Live(trainer, strategy.checkfree)
        return _drive(
            setup,
            strategy,
            failures,
            times,
            executor,
            steps,
            eval_every,
            progress,
            max_attempts,
            derived=derived,
        )
    finally:
        torch.set_num_threads(threads)


def _drive(
    setup: ConvergenceSetup,
    strategy: Strategy,
    failures: FailureSource,
    times: TimeModel,
    ex: _Executor,
    steps: int,
    eval_every: int,
    progress: Callable[[int], None] | None,
    max_attempts: int,
    *,
    derived: bool,
) -> RunResult:
    S = setup.stages
    step_s = times.step_time(strategy)
    result = RunResult(
        strategy=strategy.name,
        rate=failures.hourly_rate if strategy.kind != "none" else 0.0,
        seed=failures.seed,
        steps=steps,
        step_s=step_s,
        derived=derived,
        info={
            "strategy": strategy.to_dict(),
            "p_step": failures.probability(step_s),
            "setup": {**_fields(setup), "overrides": dict(setup.overrides)},
            "times": _fields(times),
            "eval_every": eval_every,
        },
    )
    every = strategy.checkpoint_every
    now = 0.0
    step = 0
    saved_step = 0
    saved = ex.snapshot() if every is not None or strategy.kind == "checkfree" else None
    train_losses: dict[int, float] = {}
    result.records.append(EvalRecord(step=0, time_s=0.0, val_loss=ex.evaluate(0)))
    attempt = 0
    while step < steps:
        if attempt >= max_attempts:
            # Failures outpace progress (rollbacks every few steps): stop and say so.
            result.info["finished"] = False
            result.info["reached_step"] = step
            break
        lost = [] if strategy.kind == "none" else failures.failed(attempt, S, step_s)
        this_attempt = attempt
        attempt += 1
        now += step_s
        if lost:
            attempted = step
            action, cost, lost_steps = _recover(
                strategy, times, ex, lost, S, step, this_attempt, saved_step
            )
            if action == "rollback":
                ex.restore(saved)
                step = saved_step
            now += cost
            result.events.append(
                FailureEvent(
                    attempt=this_attempt,
                    step=attempted,
                    time_s=now,
                    stages=tuple(lost),
                    action=action,
                    lost_steps=lost_steps,
                    seconds=cost,
                )
            )
            if action != "failover":
                continue  # the attempted step was abandoned; it is re-run
        loss = ex.train(step)
        if loss is not None:
            train_losses[step] = loss
        step += 1
        if progress is not None:
            progress(step)
        if every is not None and step % every == 0:
            saved = ex.snapshot()
            saved_step = step
            now += times.checkpoint_save_s
        if step % eval_every == 0 or step == steps:
            result.records.append(EvalRecord(step=step, time_s=now, val_loss=ex.evaluate(step)))
    result.info.setdefault("finished", True)
    result.total_time_s = now
    result.attempts = attempt
    result.train_losses = [train_losses[k] for k in sorted(train_losses)]
    return result


def _recover(
    strategy: Strategy,
    times: TimeModel,
    ex: _Executor,
    lost: list[int],
    num_stages: int,
    step: int,
    attempt: int,
    saved_step: int,
) -> tuple[str, float, int]:
    """What the strategy does about ``lost``: (action, seconds, committed steps undone)."""
    rollback = ("rollback", times.checkpoint_reload_s, step - saved_step)
    if strategy.kind == "redundant":
        return "failover", times.failover_s, 0
    if strategy.kind == "checkpoint":
        return rollback
    try:
        methods = ex.rebuild(lost, step, attempt)
    except RedundancyExhausted:
        if strategy.kind == "checkfree" or strategy.checkpoint_every is not None:
            return rollback
        # CheckFree+ without checkpoints and adjacent failures: rebuild what can be
        # rebuilt, re-initialise the rest (see the Note).
        methods = []
        lost_set = set(lost)
        for s in sorted(lost):
            if s - 1 in lost_set or s + 1 in lost_set:
                partner = edge_partner(s, num_stages)
                ex.reinit(s, attempt, partner is not None and partner in lost_set)
                methods.append("reinit")
        rest = [s for s in lost if not (s - 1 in lost_set or s + 1 in lost_set)]
        if rest:
            methods += ex.rebuild(rest, step, attempt)
    return ",".join(dict.fromkeys(methods)), times.recovery_s, 0


# ---- the experiment matrix ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunKey:
    """One cell of the experiment matrix."""

    strategy: Strategy
    rate: float
    seed: int

    @property
    def file_name(self) -> str:
        """Result file name inside the output folder's ``runs/``."""
        safe = "".join(c if c.isalnum() or c in "-_+." else "_" for c in self.strategy.name)
        safe = safe.replace("+", "plus")
        if self.strategy.kind == "none":
            return f"none-s{self.seed}.json"
        return f"{safe}-r{self.rate:g}-s{self.seed}.json"


SENSITIVITY_FIELDS = ("checkpoint_save_s", "checkpoint_reload_s", "failover_s", "redundant_factor")
"""`TimeModel` fields that only the exact strategies depend on."""


@dataclass(frozen=True, kw_only=True)
class ConvergenceExperiment:
    """The CheckFree study as a matrix: strategies x failure rates x seeds.

    `from_dict` reads the TOML layout of ``configs/checkfree.toml`` one to one: top-level
    keys are this class's fields, ``[model]`` is a `ConvergenceSetup`, ``[time]`` a
    `TimeModel`, ``strategies`` a list of `Strategy.parse` strings and ``[[variant]]``
    tables extra CheckFree strategies with knobs (``label``, ``strategy``, `CheckFreeConfig`
    fields, optional ``rates``).

    Raises:
        ValueError: for an unknown key, an empty or invalid list, a bad target, or two
            strategies with the same name.
    """

    setup: ConvergenceSetup
    times: TimeModel
    steps: int
    """Committed steps per run."""
    eval_every: int = 25
    """Validation every this many committed steps."""
    seeds: tuple[int, ...] = (0,)
    """Each seed sets the initial weights, the data order and the failure draws."""
    rates: tuple[float, ...] = (0.05, 0.10, 0.16)
    """Failure rates per stage-hour."""
    strategies: tuple[Strategy, ...]
    """Strategies compared at every rate (``none`` is always run once per seed)."""
    only_rates: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Strategy name -> the rates it runs at instead of ``rates`` (may include 0: the
    strategy's overhead without failures, e.g. CheckFree+'s swapped routes)."""
    target: float | None = None
    """Target validation loss; ``None``: `auto_target` of the no-failure run (per seed)."""
    target_fraction: float = 0.8
    """For the automatic target: the share of the steps at which the no-failure run's loss
    is the target."""
    derive_exact: bool = True
    """Replay exact strategies on the no-failure run instead of training them (see
    [Note: convergence simulator model])."""
    sensitivity: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """`TimeModel` field -> values at which the exact strategies (checkpointing, redundant
    computation) are re-timed by `exact_sensitivity`; only the fields that do not change
    the CheckFree runs: ``checkpoint_save_s``, ``checkpoint_reload_s``, ``failover_s``,
    ``redundant_factor``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        object.__setattr__(self, "rates", tuple(float(r) for r in self.rates))
        object.__setattr__(self, "strategies", tuple(self.strategies))
        object.__setattr__(
            self, "only_rates", {k: tuple(float(r) for r in v) for k, v in self.only_rates.items()}
        )
        _positive_int("ConvergenceExperiment", "steps", self.steps)
        _positive_int("ConvergenceExperiment", "eval_every", self.eval_every)
        if not self.seeds or not self.rates or not self.strategies:
            raise ValueError("ConvergenceExperiment needs at least one seed, rate and strategy")
        for seed in self.seeds:
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ValueError(f"ConvergenceExperiment seeds must be >= 0 integers, got {seed!r}")
        for rate in (*self.rates, *(r for v in self.only_rates.values() for r in v)):
            FailureProcess(hourly_rate=rate)  # validates
        names = [s.name for s in self.strategies]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"strategy names must be unique; repeated: {duplicates}")
        unknown = sorted(set(self.only_rates) - set(names))
        if unknown:
            raise ValueError(f"only_rates names unknown strategies {unknown}")
        object.__setattr__(
            self,
            "sensitivity",
            {k: tuple(float(x) for x in v) for k, v in self.sensitivity.items()},
        )
        bad = sorted(set(self.sensitivity) - set(SENSITIVITY_FIELDS))
        if bad:
            raise ValueError(
                f"sensitivity can vary {', '.join(SENSITIVITY_FIELDS)} (they leave the CheckFree "
                f"runs unchanged), got {bad}"
            )
        for name, values in self.sensitivity.items():
            for value in values:
                dataclasses.replace(self.times, **{name: value})  # validates
        if self.target is not None:
            _non_negative("ConvergenceExperiment", "target", self.target, positive=True)
        if not 0 < self.target_fraction <= 1:
            raise ValueError(
                f"ConvergenceExperiment target_fraction must be in (0, 1], got "
                f"{self.target_fraction!r}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConvergenceExperiment:
        """Build from the parsed TOML (``kind`` and output keys already removed).

        Raises:
            ValueError: for unknown keys or invalid values (the message names them).
        """
        data = dict(data)
        model = dict(data.pop("model", {}))
        time_model = dict(data.pop("time", {}))
        variants = list(data.pop("variant", []))
        sensitivity = dict(data.pop("sensitivity", {}))
        strategy_texts = list(data.pop("strategies", ["checkfree", "checkfree+", "checkpoint:50"]))
        target = data.pop("target", "auto")
        for owner, given, klass in (
            ("[model]", model, ConvergenceSetup),
            ("[time]", time_model, TimeModel),
        ):
            unknown = sorted(set(given) - set(klass.__dataclass_fields__))
            if unknown:
                raise ValueError(
                    f"unknown key(s) {unknown} in {owner}; known: "
                    f"{sorted(klass.__dataclass_fields__)}"
                )
        allowed = set(cls.__dataclass_fields__) - {
            "setup",
            "times",
            "strategies",
            "only_rates",
            "target",
            "sensitivity",
        }
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown top-level key(s) {unknown}; known: {sorted(allowed)}")
        if isinstance(target, str):
            if target != "auto":
                raise ValueError(f"target must be a number or 'auto', got {target!r}")
            target_value: float | None = None
        else:
            target_value = float(target)
        strategies = [Strategy.parse(text) for text in strategy_texts]
        only_rates: dict[str, tuple[float, ...]] = {}
        for entry in variants:
            entry = dict(entry)
            base = entry.pop("strategy", None)
            if base is None or "label" not in entry:
                raise ValueError(f"a [[variant]] needs 'strategy' and 'label', got {entry!r}")
            rates = entry.pop("rates", None)
            strategy = Strategy.parse(str(base), **entry)
            strategies.append(strategy)
            if rates is not None:
                only_rates[strategy.name] = tuple(rates)
        return cls(
            setup=ConvergenceSetup(**model),
            times=TimeModel(**time_model),
            strategies=tuple(strategies),
            only_rates=only_rates,
            target=target_value,
            sensitivity=sensitivity,
            **data,
        )

    def baselines(self) -> list[RunKey]:
        """The no-failure run of every seed."""
        none = Strategy(kind="none")
        return [RunKey(strategy=none, rate=0.0, seed=seed) for seed in self.seeds]

    def runs(self) -> list[RunKey]:
        """Every run with failures: strategies x their rates x seeds."""
        keys = []
        for seed in self.seeds:
            for strategy in self.strategies:
                if strategy.kind == "none":
                    continue
                for rate in self.only_rates.get(strategy.name, self.rates):
                    keys.append(RunKey(strategy=strategy, rate=rate, seed=seed))
        return keys

    def run(
        self,
        key: RunKey,
        *,
        baseline: RunResult | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Run one cell (exact strategies replay ``baseline`` when ``derive_exact``)."""
        return run_convergence(
            self.setup.with_seed(key.seed),
            key.strategy,
            FailureProcess(hourly_rate=key.rate, seed=key.seed),
            self.times,
            steps=self.steps,
            eval_every=self.eval_every,
            baseline=baseline if self.derive_exact else None,
            progress=progress,
        )


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def steps_to_loss(baseline: RunResult, loss: float) -> float | None:
    """How many steps the no-failure ``baseline`` needs to reach ``loss`` (interpolated
    between its evaluations), or ``None`` if it never does.

    ``run.steps - steps_to_loss(baseline, run.final_loss())`` is how many steps of
    progress a run's recoveries cost, in no-failure steps (``steps_behind`` in `summarize`).
    """
    prev: EvalRecord | None = None
    for record in baseline.records:
        if record.val_loss <= loss:
            if prev is None or prev.val_loss <= record.val_loss:
                return float(record.step)
            frac = (prev.val_loss - loss) / (prev.val_loss - record.val_loss)
            return prev.step + frac * (record.step - prev.step)
        prev = record
    return None


def display_rank(name: str) -> int:
    """Where a strategy goes in tables: none, CheckFree, CheckFree+, variants, redundant,
    best checkpointing, each checkpoint interval."""
    fixed = {"none": 0, "checkfree": 1, "checkfree+": 2, "redundant": 4, "checkpoint (best)": 5}
    if name in fixed:
        return fixed[name]
    return 6 if name.startswith("checkpoint-") else 3


def summarize(
    results: Sequence[RunResult],
    targets: Mapping[int, float],
) -> list[dict[str, Any]]:
    """One row per (strategy, rate): time to target (mean over seeds), failures, losses.

    ``steps_behind``: the no-failure steps' worth of progress the recoveries cost (how many
    fewer steps the no-failure run needs to reach this run's final loss); ``rebuilds``:
    stages rebuilt by CheckFree(+) (not rolled back).

    ``targets`` maps seed -> target loss. A row's ``time_to_target_h`` is the mean over
    the seeds that reached the target (``None`` if none did); ``reached`` counts them.
    Rows with ``strategy = "checkpoint (best)"`` take, per rate, the checkpoint interval
    with the smallest mean time. ``vs_best_checkpoint`` is that time divided by the row's
    (> 1: faster than the best checkpointing), ``vs_redundant`` likewise.
    """
    groups: dict[tuple[str, float], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.strategy, r.rate), []).append(r)
    baselines = {r.seed: r for r in results if r.strategy == "none"}

    def steps_behind(run: RunResult) -> float | None:
        base = baselines.get(run.seed)
        if base is None:
            return None
        reached = steps_to_loss(base, run.final_loss())
        return run.steps - reached if reached is not None else None

    rows: list[dict[str, Any]] = []
    for (name, rate), runs in groups.items():
        times = [r.time_to(targets[r.seed]) for r in runs]
        reached = [t for t in times if t is not None]
        rows.append(
            {
                "strategy": name,
                "rate": rate,
                "seeds": len(runs),
                "reached": len(reached),
                "time_to_target_h": (sum(reached) / len(reached) / 3600) if reached else None,
                "final_val_loss": sum(r.final_loss() for r in runs) / len(runs),
                "total_time_h": sum(r.total_time_s for r in runs) / len(runs) / 3600,
                "failures": sum(sum(len(e.stages) for e in r.events) for r in runs) / len(runs),
                "rollbacks": sum(sum(e.action == "rollback" for e in r.events) for r in runs)
                / len(runs),
                "lost_steps": sum(sum(e.lost_steps for e in r.events) for r in runs) / len(runs),
                "steps_behind": _mean([steps_behind(r) for r in runs]),
                "rebuilds": sum(
                    sum(len(e.stages) for e in r.events if e.action not in ("rollback", "failover"))
                    for r in runs
                )
                / len(runs),
            }
        )
    for rate in sorted({row["rate"] for row in rows}):
        ckpts = [
            row
            for row in rows
            if row["rate"] == rate
            and row["strategy"].startswith("checkpoint-")
            and row["time_to_target_h"] is not None
        ]
        if ckpts:
            best = min(ckpts, key=lambda row: row["time_to_target_h"])
            rows.append({**best, "strategy": "checkpoint (best)", "best_of": best["strategy"]})
    for row in rows:
        peers = {r["strategy"]: r for r in rows if r["rate"] == row["rate"]}
        for column, ref in (
            ("vs_best_checkpoint", "checkpoint (best)"),
            ("vs_redundant", "redundant"),
        ):
            other = peers.get(ref, {}).get("time_to_target_h")
            mine = row["time_to_target_h"]
            row[column] = other / mine if other is not None and mine else None
    rows.sort(key=lambda row: (row["rate"], display_rank(row["strategy"]), row["strategy"]))
    return rows


def exact_sensitivity(
    experiment: ConvergenceExperiment,
    baselines: Mapping[int, RunResult],
    targets: Mapping[int, float],
) -> list[dict[str, Any]]:
    """Time to target of the exact strategies as one cost of `experiment.sensitivity` varies.

    Each exact strategy (checkpointing, redundant computation) is re-timed on the no-failure
    ``baselines`` (by seed) at every value; a row per (field, value, rate, strategy) holds the
    mean time over the seeds that reach ``targets[seed]`` (``None`` if none does), plus a
    ``"checkpoint (best)"`` row per (field, value, rate).
    """
    rows: list[dict[str, Any]] = []
    exact = [s for s in experiment.strategies if s.exact and s.kind != "none"]
    for name, values in experiment.sensitivity.items():
        for value in values:
            times = dataclasses.replace(experiment.times, **{name: value})
            for rate in experiment.rates:
                group: list[dict[str, Any]] = []
                for strategy in exact:
                    reached = []
                    for seed, base in baselines.items():
                        run = run_convergence(
                            experiment.setup.with_seed(seed),
                            strategy,
                            FailureProcess(hourly_rate=rate, seed=seed),
                            times,
                            steps=experiment.steps,
                            eval_every=experiment.eval_every,
                            baseline=base,
                        )
                        t = run.time_to(targets[seed])
                        if t is not None:
                            reached.append(t)
                    hours = sum(reached) / len(reached) / 3600 if reached else None
                    group.append(
                        {"field": name, "value": value, "rate": rate, "strategy": strategy.name,
                         "time_to_target_h": hours}
                    )  # fmt: skip
                ckpts = [
                    g for g in group
                    if g["strategy"].startswith("checkpoint-") and g["time_to_target_h"] is not None
                ]  # fmt: skip
                if ckpts:
                    best = min(ckpts, key=lambda g: g["time_to_target_h"])
                    group.append(
                        {**best, "strategy": "checkpoint (best)", "best_of": best["strategy"]}
                    )
                rows.extend(group)
    return rows
