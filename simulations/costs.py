"""What recovery costs: the measured (or assumed) times and sizes every simulator uses.

One cost vocabulary for the three simulators. :class:`Costs` holds what every simulated
job pays -- the step, the durable checkpoint's write and load -- and :class:`RecoveryCosts`
adds what replacing dead workers costs -- detection, the replacement, state transfer. Each
simulator's model is one of them with the defaults of its setting: :class:`CostModel` (the
cluster simulator, :mod:`simulations.cluster`), :class:`TimeModel` (the convergence
simulator, :mod:`simulations.convergence`) and :class:`EmbeddingTimeModel` (the embedding
simulator, :mod:`simulations.embedding`). A field means the same in every model, is
validated the same way and is read from a user's file by the same
:meth:`Costs.from_dict`.

Names and units: a duration is ``<what>_s``, in seconds of the whole job's wall clock; a
size ``<what>_bytes``; a rate ``<what>_bytes_per_s``, in bytes (never bits) per second, so
a 10 Gb/s link is ``1.25e9``; a count of steps ``<what>_steps``. The shared fields are
``step_s`` (one failure-free step), ``checkpoint_write_s`` / ``checkpoint_load_s`` (the
blocking write of one durable checkpoint / loading it after a failure), ``detect_s``
(death -> the controller acts), ``replace_s`` (a replacement started and joined) and
``transfer_bytes_per_s`` (worker-to-worker state copies). A name a model used before it
was unified is refused with its new one (:data:`RENAMED`; `parallelism.checks.check_renamed`,
which `recovery.policy.RecoveryPolicy` uses too), so a user's TOML table, calibration file
or flag never silently loses a value.

The module also holds the checkpoint theory the cluster simulator is validated against:
Young's and Daly's optimal intervals and the expected fraction of wall time that
checkpoint-restart wastes (see RESEARCH.md, "Failure rates and checkpoint theory").
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

from parallelism.checks import check_renamed
from simulations.policies import SimulatedPolicy

if TYPE_CHECKING:
    from simulations.convergence_config import ConvergencePolicy

__all__ = [
    "RENAMED",
    "CostModel",
    "Costs",
    "EmbeddingTimeModel",
    "RecoveryCosts",
    "TimeModel",
    "check_renamed",
    "daly_interval",
    "daly_waste",
    "young_interval",
    "young_waste",
]

RENAMED: Mapping[str, str] = {
    "checkpoint_save_s": "checkpoint_write_s",
    "checkpoint_reload_s": "checkpoint_load_s",
    "bandwidth_bytes_per_s": "transfer_bytes_per_s",
}
"""Cost fields renamed so that every model spells a quantity one way: old -> new."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What every simulated job pays, whatever its recovery: the fields all three models share.

    A model subclasses this (or :class:`RecoveryCosts`) and gives each field the default
    of its setting; the meaning stays the one stated here. Every field is a number: not
    NaN, ``>= 0`` (``> 0`` for the model's ``_POSITIVE`` ones) and finite (except the
    model's ``_MAY_BE_INF`` ones); the fields named in ``_SETTINGS`` are not costs and are
    checked by the model.

    Raises:
        ValueError: naming the model, the field and the bad value.
    """

    step_s: float
    """One failure-free optimizer step of the whole job."""
    checkpoint_write_s: float
    """Blocking time of one durable checkpoint (the ``C`` of Young/Daly)."""
    checkpoint_load_s: float
    """Loading the durable checkpoint after a failure."""

    _POSITIVE: ClassVar[frozenset[str]] = frozenset()
    _MAY_BE_INF: ClassVar[frozenset[str]] = frozenset()
    _SETTINGS: ClassVar[frozenset[str]] = frozenset()
    renamed: ClassVar[Mapping[str, str]] = RENAMED
    """This model's old field names -> new ones (refused by :meth:`from_dict`)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for f in dataclasses.fields(self):
            if f.name in self._SETTINGS:
                continue
            name, value = f"{owner}.{f.name}", getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if f.name in self._POSITIVE and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
            if math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
            if math.isinf(value) and f.name not in self._MAY_BE_INF:
                raise ValueError(f"{name} must be finite, got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str | None = None) -> Self:
        """Build from a mapping of field names to values; absent fields keep the defaults.

        Keys starting with ``_`` are metadata (provenance, units) and are ignored.
        ``where`` names the source in errors (e.g. ``"[time]"``).

        Raises:
            ValueError: for a field by its old name (naming the new one), an unknown
                field, or a bad value.
        """
        if not isinstance(data, Mapping):
            raise ValueError(
                f"a {cls.__name__} must be a JSON object or TOML table, got {type(data).__name__}"
            )
        values = {k: v for k, v in data.items() if not str(k).startswith("_")}
        check_renamed(values, where or cls.__name__, cls.renamed)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            place = f" in {where}" if where else ""
            raise ValueError(
                f"unknown {cls.__name__} field(s) {unknown}{place}; known: {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain mapping (what :meth:`from_dict` reads back)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class RecoveryCosts(Costs):
    """:class:`Costs` plus what replacing dead workers costs, for the models that charge a
    recovery by its parts (the cluster and embedding simulators; the convergence simulator
    charges one ``recovery_s``).

    Raises:
        ValueError: naming the model, the field and the bad value.
    """

    detect_s: float
    """From a worker's death to the controller acting on it."""
    replace_s: float
    """Starting one replacement worker and having it join the job."""
    transfer_bytes_per_s: float
    """Worker-to-worker bandwidth for state copies, in bytes per second (> 0; ``inf``:
    free transfer)."""

    _POSITIVE: ClassVar[frozenset[str]] = frozenset({"transfer_bytes_per_s"})
    _MAY_BE_INF: ClassVar[frozenset[str]] = frozenset({"transfer_bytes_per_s"})

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over one worker-to-worker link."""
        return nbytes / self.transfer_bytes_per_s


# A Llama-3-405B-like model: 405e9 parameters; training state per parameter = bf16 weight
# (2 B) + bf16 gradient (2 B) + fp32 master weight and two Adam moments (12 B) = 16 B.
_PARAMS_405B = 405e9


@dataclass(frozen=True, kw_only=True)
class CostModel(RecoveryCosts):
    """The cluster simulator's costs of failure and recovery for one model on one kind of
    hardware.

    Every time is in seconds of wall-clock time as the *whole job* sees it (a recovery
    stalls every worker, see ``[Note: simulator model]`` in :mod:`simulations.cluster`).
    A calibration file written by ``scripts/bench.py`` sets any subset of the fields; the
    others keep the defaults below.

    Raises:
        ValueError: if a field is negative, not finite where it must be (only
            ``transfer_bytes_per_s`` may be ``inf``), or of the wrong type (the message
            names the field and the value).
    """

    detect_s: float = 10.0
    """From a worker's death to the controller acting on it: transport error or missed
    heartbeat. torchft's default 5 s heartbeat gives ~5 s (RESEARCH.md); a hung NCCL
    collective without a watchdog can take minutes."""

    replace_s: float = 120.0
    """Cold start of one replacement worker: schedule a spare node, start the container
    and Python, import torch, initialise CUDA. Measured ~3 s for a bare process on a
    small machine (RESEARCH.md); 120 s is an assumption for a scheduled spare node."""

    replace_warm_s: float = 10.0
    """A warm spare (process already running, CUDA initialised) joining the job."""

    reform_s: float = 15.0
    """Forming the new generation: fresh process groups on every worker."""

    restart_s: float = 300.0
    """Tear-down and restart of the whole job (every worker), excluding the checkpoint
    load: what torchrun / Ray Train restart costs at scale. FlashRecovery reports 150 s
    for an optimised 4,800-device restore (RESEARCH.md); 300 s is an assumption."""

    step_s: float = 6.0
    """One optimizer step of the job: 6 x 405e9 x 16M tokens / (16,384 GPUs x 400 TFLOP/s)."""

    model_state_bytes: float = 16.0 * _PARAMS_405B
    """Training state of one pipeline replica (weights, gradients, optimizer state) in
    bytes; a worker holds ``1 / (pp * tp)`` of it per GPU. A replica copy moves this."""

    model_weight_bytes: float = 2.0 * _PARAMS_405B
    """Weights only (bf16) of one pipeline replica; neighbour averaging reads the two
    neighbours' weights, not their optimizer state (the rebuilt stage starts a fresh
    optimizer)."""

    transfer_bytes_per_s: float = 25e9
    """Worker-to-worker bandwidth per GPU (200 Gb/s); each GPU of a worker receives its
    shard in parallel. May be ``inf`` (free transfer)."""

    checkpoint_write_s: float = 60.0
    """Blocking time of one durable checkpoint (the ``C`` of Young/Daly); asynchronous
    checkpointing makes it the time to copy state off the GPU. An assumption."""

    checkpoint_load_s: float = 120.0
    """Loading the durable checkpoint into every worker after a restart. An assumption."""

    snapshot_write_s: float = 2.0
    """Blocking time of one in-memory snapshot (GPU to host memory, then to a peer in the
    background, as Gemini does)."""

    snapshot_load_s: float = 10.0
    """Restoring every worker from its host-memory (or peer) snapshot."""

    approx_penalty_steps: float = 50.0
    """Convergence penalty of one approximate recovery (CheckFree neighbour averaging or
    CheckFree+ edge copy), in optimizer steps of training progress lost. Read off the
    CheckFree paper (RESEARCH.md): it converged at least as fast as checkpointing every
    10-100 steps, and a rollback to a checkpoint taken every 100 steps loses 50 steps on
    average, so 50 is an upper-end default. The real value depends on the model, the
    number of stages and the learning-rate schedule: calibrate it."""

    pls_penalty_scale: float = 1.0
    """CPR partial recovery: training progress lost per second of staleness of the
    restored shard, per unit share of the model the shard holds (the PLS proxy: a shard
    with share f restored ``a`` seconds stale costs ``scale * f * a`` seconds)."""

    @classmethod
    def zero(cls) -> CostModel:
        """Every recovery free and instantaneous: the simulator must report goodput 1."""
        fields = {f.name: 0.0 for f in dataclasses.fields(cls)}
        fields["transfer_bytes_per_s"] = math.inf
        return cls(**fields)

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        """Read a calibration file written by ``scripts/bench.py`` (or :meth:`to_json`).

        Raises:
            ValueError: if the file cannot be read, is not JSON, or holds a bad field.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read calibration file {path}: {err}") from err
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"calibration file {path} is not valid JSON: {err}") from err
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"calibration file {path}: {err}") from err

    def to_json(self, path: str | Path) -> None:
        """Write every field to ``path`` as a JSON object (``inf`` as ``Infinity``).

        Raises:
            ValueError: if the file cannot be written.
        """
        try:
            Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        except OSError as err:
            raise ValueError(f"cannot write calibration file {path}: {err}") from err


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or math.isnan(value):
            raise ValueError(f"{name} must be > 0, got {value!r}")


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's (1974) optimal work time between checkpoints, ``sqrt(2 C M)``.

    Raises:
        ValueError: if ``checkpoint_s`` is negative or ``mtbf_s`` is not positive.
    """
    _check_positive(mtbf_s=mtbf_s)
    if checkpoint_s < 0:
        raise ValueError(f"checkpoint_s must be >= 0, got {checkpoint_s!r}")
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimal work time between checkpoints.

    ``T = sqrt(2CM) (1 + sqrt(C/(2M))/3 + C/(18M)) - C`` for ``C < 2M``, else ``M``.

    Raises:
        ValueError: if ``checkpoint_s`` is negative or ``mtbf_s`` is not positive.
    """
    _check_positive(mtbf_s=mtbf_s)
    if checkpoint_s < 0:
        raise ValueError(f"checkpoint_s must be >= 0, got {checkpoint_s!r}")
    c, m = checkpoint_s, mtbf_s
    if c >= 2.0 * m:
        return m
    root = math.sqrt(2.0 * c * m)
    return max(0.0, root * (1.0 + math.sqrt(c / (2.0 * m)) / 3.0 + c / (18.0 * m)) - c)


def young_waste(
    *, interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float
) -> float:
    """First-order expected fraction of wall time wasted: ``C/T + (T/2 + R)/M``.

    Accurate while ``C`` and ``R`` are small against ``M`` (within ~2% of the exact
    value for ``C/M < 1e-3``); it ignores failures during checkpoints and restarts.

    Raises:
        ValueError: if ``interval_s`` or ``mtbf_s`` is not positive.
    """
    _check_positive(interval_s=interval_s, mtbf_s=mtbf_s)
    return checkpoint_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s


def daly_waste(*, interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Exact expected fraction of wall time wasted under exponential failures (Daly 2006).

    Each segment of ``T`` work and ``C`` checkpoint write takes, in expectation,
    ``M e^{R/M} (e^{(T+C)/M} - 1)`` wall time when a failure may strike at any moment,
    including during writes and restarts (a failure during a restart starts it again).
    The waste is ``1 - T / that``. :mod:`simulations.cluster` implements exactly this
    model for ``checkpoint_restart``, so the two must agree up to Monte Carlo noise.

    Raises:
        ValueError: if ``interval_s`` or ``mtbf_s`` is not positive.
    """
    _check_positive(interval_s=interval_s, mtbf_s=mtbf_s)
    m = mtbf_s
    segment = m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m)
    return 1.0 - interval_s / segment


@dataclass(frozen=True, kw_only=True)
class TimeModel(Costs):
    """The convergence simulator's wall-clock costs, in seconds (see [Note: convergence
    simulator model]).

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
    checkpoint_write_s: float = 10.0
    """Saving one checkpoint to remote storage (stages upload their parts in parallel)."""
    checkpoint_load_s: float = 120.0
    """Rollback: a replacement node joins and every stage downloads the checkpoint."""
    failover_s: float = 10.0
    """Redundant computation: the neighbour holding the copy takes over."""
    redundant_factor: float = 4.0 / 3.0
    """Step-time multiplier of redundant computation (Bamboo): each stage also runs its
    successor's forward pass; with backward = 2 x forward that is +1/3 of the compute,
    assumed not hidden in pipeline bubbles."""

    _POSITIVE: ClassVar[frozenset[str]] = frozenset({"step_s", "redundant_factor"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.redundant_factor < 1:
            raise ValueError(
                f"TimeModel.redundant_factor must be >= 1, got {self.redundant_factor!r}"
            )

    def step_time(self, policy: ConvergencePolicy) -> float:
        """Seconds per attempted step under ``policy``."""
        redundant = policy.kind == SimulatedPolicy.REDUNDANT
        return self.step_s * (self.redundant_factor if redundant else 1.0)


@dataclass(frozen=True, kw_only=True)
class EmbeddingTimeModel(RecoveryCosts):
    """The embedding simulator's wall-clock costs. See [Note: embedding simulator model].

    Raises:
        ValueError: naming a bad field and value (``step_s`` and
            ``transfer_bytes_per_s`` must be > 0).
    """

    step_s: float = 1.0
    """One training step of the job."""
    checkpoint_write_s: float = 15.0
    """Blocking time of one checkpoint (the ``C`` of Young/Daly)."""
    checkpoint_load_s: float = 30.0
    """Reloading the whole checkpoint into every worker (a shard: this over ``W``)."""
    detect_s: float = 5.0
    """From a death to the controller acting on it."""
    replace_s: float = 10.0
    """Starting a replacement worker and forming the new process groups."""
    transfer_bytes_per_s: float = 1.25e9
    """Worker-to-worker bandwidth (10 Gb/s) for mirror traffic and peer state copies."""
    checkpoint_formula: str = "daly"
    """``"daly"`` or ``"young"``: which optimal checkpoint interval to use by default (as
    the cluster simulator's ``--checkpoint-formula``)."""

    _POSITIVE: ClassVar[frozenset[str]] = frozenset({"step_s", "transfer_bytes_per_s"})
    _SETTINGS: ClassVar[frozenset[str]] = frozenset({"checkpoint_formula"})
    renamed: ClassVar[Mapping[str, str]] = {**RENAMED, "interval": "checkpoint_formula"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoint_formula not in ("daly", "young"):
            raise ValueError(
                "EmbeddingTimeModel.checkpoint_formula must be 'daly' or 'young', "
                f"got {self.checkpoint_formula!r}"
            )

    def checkpoint_every(self, steps: int, failures: int) -> int:
        """The optimal checkpoint interval in steps for ``failures`` failures in ``steps``.

        The MTBF is the failure-free run time over the failures; without failures, one
        checkpoint at the end (``steps``).
        """
        if failures <= 0:
            return steps
        mtbf = steps * self.step_s / failures
        fn = daly_interval if self.checkpoint_formula == "daly" else young_interval
        seconds = fn(self.checkpoint_write_s, mtbf)
        return max(1, min(steps, round(seconds / self.step_s)))
