"""What one convergence run is: the job (`ConvergenceSetup`) and the simulated policy
(`ConvergencePolicy`). See [Note: convergence simulator model] in `simulations.convergence`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from parallelism.checks import check_number, check_positive_int
from parallelism.workloads.data import LMBatches, TokenCorpus
from parallelism.workloads.llama import (
    LlamaConfig,
)
from recovery.strategies.checkfree import (
    CheckFreeConfig,
)
from simulations.policies import SimulatedPolicy

__all__ = ["KINDS", "ConvergencePolicy", "ConvergenceSetup"]

KINDS = (
    SimulatedPolicy.NONE,
    SimulatedPolicy.CHECKFREE,
    SimulatedPolicy.CHECKFREE_PLUS,
    SimulatedPolicy.CHECKPOINT,
    SimulatedPolicy.REDUNDANT,
)
"""The simulated policies; see [Note: convergence simulator model]."""


def _positive_int(owner: str, name: str, value: object) -> None:
    check_positive_int(f"{owner} {name}", value)


def _non_negative(owner: str, name: str, value: object, *, positive: bool = False) -> None:
    check_number(f"{owner} {name}", value, positive=positive, minimum=None if positive else 0.0)


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
    # dataclasses.fields, not __dataclass_fields__: that also holds the ClassVars.
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass(frozen=True, kw_only=True)
class ConvergencePolicy:
    """A recovery strategy and its knobs. `ConvergencePolicy.parse` reads ``"checkpoint:50"``.

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
            _positive_int("ConvergencePolicy", "checkpoint_every", self.checkpoint_every)
        if self.kind == SimulatedPolicy.CHECKPOINT and self.checkpoint_every is None:
            raise ValueError("strategy 'checkpoint' needs checkpoint_every (e.g. 'checkpoint:50')")
        if (
            self.kind in (SimulatedPolicy.NONE, SimulatedPolicy.REDUNDANT)
            and self.checkpoint_every is not None
        ):
            raise ValueError(f"strategy {self.kind!r} takes no checkpoint_every")
        if not self.is_checkfree and self.checkfree != CheckFreeConfig():
            raise ValueError(f"CheckFree knobs given to strategy {self.kind!r}")
        _positive_int("ConvergencePolicy", "swap_every", self.swap_every)
        if self.swap_every < 2:
            raise ValueError(f"ConvergencePolicy swap_every must be >= 2, got {self.swap_every}")
        if self.kind != SimulatedPolicy.CHECKFREE_PLUS and self.swap_every != 2:
            raise ValueError(f"swap_every is a CheckFree+ knob, given to {self.kind!r}")
        if not isinstance(self.checkfree, CheckFreeConfig):
            raise ValueError(
                f"ConvergencePolicy checkfree must be a CheckFreeConfig, got {self.checkfree!r}"
            )

    @classmethod
    def parse(cls, text: str, **knobs: Any) -> ConvergencePolicy:
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
        if self.kind == SimulatedPolicy.CHECKPOINT:
            return f"checkpoint-{self.checkpoint_every}"
        return self.kind

    @property
    def is_checkfree(self) -> bool:
        """Whether this is ``checkfree`` or ``checkfree+``."""
        return self.kind in (SimulatedPolicy.CHECKFREE, SimulatedPolicy.CHECKFREE_PLUS)

    @property
    def plus(self) -> bool:
        """Whether this runs CheckFree+ (swapped routes, edge replicas)."""
        return self.kind == SimulatedPolicy.CHECKFREE_PLUS

    @property
    def exact(self) -> bool:
        """Whether failures never change what is trained (only when): see the Note."""
        return self.kind in (
            SimulatedPolicy.NONE,
            SimulatedPolicy.CHECKPOINT,
            SimulatedPolicy.REDUNDANT,
        )

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
