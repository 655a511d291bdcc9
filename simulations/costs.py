"""What recovery costs: the measured (or assumed) times and sizes every simulator uses.

:class:`CostModel` holds one number per cost a recovery strategy pays -- detection,
replacement, state transfer, checkpoint writes and loads, the step time, the convergence
penalty of an approximate recovery. The defaults describe a Llama-3-405B-like job on H100
nodes; they are order-of-magnitude assumptions, each stated under its field, until
``scripts/bench.py`` measures them and writes a calibration file that
:meth:`CostModel.from_json` reads. The module also holds the checkpoint theory the
simulator is validated against: Young's and Daly's optimal intervals and the expected
fraction of wall time that checkpoint-restart wastes (see RESEARCH.md, "Failure rates and
checkpoint theory").

The three simulators' models -- :class:`CostModel` (cluster), :class:`TimeModel`
(convergence) and :class:`EmbeddingTimeModel` (embedding tables) -- describe different
settings, so their defaults differ, but they name a quantity the same way: a duration is
``<what>_s`` in seconds of the whole job's wall clock, a size ``<what>_bytes``, a rate
``<what>_bytes_per_s``; ``step_s`` (one step), ``detect_s`` (death -> the controller acts),
``replace_s`` (a replacement started and joined), ``checkpoint_write_s`` /
``checkpoint_load_s`` (the blocking write of one checkpoint / reloading it everywhere) and
``transfer_bytes_per_s`` (worker-to-worker state copies) mean the same in each. Older
names are refused with the new one (:func:`check_renamed`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parallelism.checks import check_number
from simulations.policies import SimulatedPolicy

if TYPE_CHECKING:
    from simulations.convergence_config import ConvergencePolicy

__all__ = [
    "RENAMED",
    "CostModel",
    "EmbeddingTimeModel",
    "TimeModel",
    "check_renamed",
    "daly_interval",
    "daly_waste",
    "young_interval",
    "young_waste",
]

RENAMED = {
    "checkpoint_save_s": "checkpoint_write_s",
    "checkpoint_reload_s": "checkpoint_load_s",
    "bandwidth_bytes_per_s": "transfer_bytes_per_s",
}
"""Cost fields renamed so that every model spells a quantity one way: old -> new."""


def check_renamed(keys: Iterable[str], where: str) -> None:
    """Refuse cost fields by their old names (a user's TOML or JSON file).

    Raises:
        ValueError: naming each old key, its new name, and ``where`` it was found.
    """
    old = [key for key in keys if key in RENAMED]
    if old:
        renames = ", ".join(f"{key!r} is now {RENAMED[key]!r}" for key in old)
        raise ValueError(f"renamed key(s) in {where}: {renames}")


# A Llama-3-405B-like model: 405e9 parameters; training state per parameter = bf16 weight
# (2 B) + bf16 gradient (2 B) + fp32 master weight and two Adam moments (12 B) = 16 B.
_PARAMS_405B = 405e9


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The costs of failure and recovery for one model on one kind of hardware.

    Every time is in seconds of wall-clock time as the *whole job* sees it (a recovery
    stalls every worker, see ``[Note: simulator model]`` in :mod:`simulations.cluster`).
    A calibration file written by ``scripts/bench.py`` sets any subset of the fields; the
    others keep the defaults below.

    Raises:
        ValueError: if a field is negative, not finite where it must be, or of the wrong
            type (the message names the field and the value).
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

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"CostModel.{field.name} must be a number, got {value!r}")
            if math.isnan(value) or value < 0:
                raise ValueError(f"CostModel.{field.name} must be >= 0, got {value!r}")
            if math.isinf(value) and field.name != "transfer_bytes_per_s":
                raise ValueError(f"CostModel.{field.name} must be finite, got {value!r}")
        if self.transfer_bytes_per_s == 0:
            raise ValueError("CostModel.transfer_bytes_per_s must be > 0 (inf for free transfer)")

    @classmethod
    def zero(cls) -> CostModel:
        """Every recovery free and instantaneous: the simulator must report goodput 1."""
        fields = {f.name: 0.0 for f in dataclasses.fields(cls)}
        fields["transfer_bytes_per_s"] = math.inf
        return cls(**fields)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """Build from a mapping of field names to numbers; absent fields keep defaults.

        Keys starting with ``_`` are metadata (provenance, units) and are ignored.

        Raises:
            ValueError: on an unknown field or a bad value.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a cost model must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if not str(k).startswith("_")}
        check_renamed(values, "the cost model")
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown CostModel field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

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

    def to_dict(self) -> dict[str, float]:
        """The fields as a plain mapping (what :meth:`from_dict` reads back)."""
        return dataclasses.asdict(self)

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

    def __post_init__(self) -> None:
        check_number("TimeModel step_s", self.step_s, positive=True)
        for name in ("recovery_s", "checkpoint_write_s", "checkpoint_load_s", "failover_s"):
            check_number(f"TimeModel {name}", getattr(self, name), minimum=0.0)
        check_number("TimeModel redundant_factor", self.redundant_factor, positive=True)
        if self.redundant_factor < 1:
            raise ValueError(
                f"TimeModel redundant_factor must be >= 1, got {self.redundant_factor!r}"
            )

    def step_time(self, policy: ConvergencePolicy) -> float:
        """Seconds per attempted step under ``policy``."""
        redundant = policy.kind == SimulatedPolicy.REDUNDANT
        return self.step_s * (self.redundant_factor if redundant else 1.0)


@dataclass(frozen=True, kw_only=True)
class EmbeddingTimeModel:
    """Modelled wall-clock costs. See [Note: embedding simulator model].

    Raises:
        ValueError: naming a bad field and value.
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
    interval: str = "daly"
    """``"daly"`` or ``"young"``: which optimal checkpoint interval to use by default."""

    def __post_init__(self) -> None:
        for name in ("step_s", "transfer_bytes_per_s"):
            check_number(f"EmbeddingTimeModel.{name}", getattr(self, name), positive=True)
        for name in ("checkpoint_write_s", "checkpoint_load_s", "detect_s", "replace_s"):
            check_number(f"EmbeddingTimeModel.{name}", getattr(self, name), minimum=0.0)
        if self.interval not in ("daly", "young"):
            raise ValueError(
                f"EmbeddingTimeModel.interval must be 'daly' or 'young', got {self.interval!r}"
            )

    def checkpoint_every(self, steps: int, failures: int) -> int:
        """The optimal checkpoint interval in steps for ``failures`` failures in ``steps``.

        The MTBF is the failure-free run time over the failures; without failures, one
        checkpoint at the end (``steps``).
        """
        if failures <= 0:
            return steps
        mtbf = steps * self.step_s / failures
        fn = daly_interval if self.interval == "daly" else young_interval
        seconds = fn(self.checkpoint_write_s, mtbf)
        return max(1, min(steps, round(seconds / self.step_s)))

    def transfer_s(self, nbytes: float) -> float:
        return nbytes / self.transfer_bytes_per_s
