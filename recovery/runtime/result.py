"""`FitResult`: what `Trainer.fit` returns -- the losses and metrics of every step, the
recoveries, the timings and every worker's final state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from recovery.events import RecoveryEvent
from recovery.integrity.fingerprint import digest

__all__ = ["FitResult"]


@dataclass
class FitResult:
    """What `Trainer.fit` returns."""

    losses: list[float]
    """Training loss of every step, in step order. A step redone after a rollback counts
    once, with the loss of its final run."""
    metrics: list[dict[str, Any]]
    """One record per committed step in the order they ran, redone steps included (loss,
    time, step_s, tokens_per_s, grad norms...)."""
    events: list[RecoveryEvent]
    """Every failure and recovery, in order."""
    wall_s: float
    """Seconds from the first step to the last commit (startup excluded)."""
    startup_s: float
    """Seconds to start and set up the workers and form the first generation."""
    run_dir: Path | None = None
    timings: dict[str, list[float]] = field(default_factory=dict)
    """Seconds training was blocked per kind of work: ``checkpoint_write`` (the restart
    baseline), ``snapshot_write`` (peer tier), ``durable_write`` (starting async writes)."""
    states: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict, repr=False)
    mirrors: dict[str, float] = field(default_factory=dict)
    """Embedding tables: what the shard mirrors cost per worker (bytes): the mirror's
    memory, the shard's own size, and the update traffic per step."""

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        """(step, validation loss) at every evaluation."""
        return [
            (m["step"] + 1, m["val_loss"]) for m in self.metrics if m.get("val_loss") is not None
        ]

    @property
    def steps_per_s(self) -> float:
        return len(self.losses) / self.wall_s if self.wall_s > 0 else math.nan

    def state(self, stage: int, replica: int) -> dict[str, torch.Tensor]:
        """The final model state_dict of worker ``(stage, replica)``.

        Raises:
            KeyError: if states were not collected (``Trainer(collect_states=False)``).
        """
        return self.states[(stage, replica)]["model"]

    def optimizer_state(self, stage: int, replica: int) -> dict[str, Any]:
        """The final optimizer state_dict of worker ``(stage, replica)``."""
        return self.states[(stage, replica)]["optimizer"]

    def state_digest(self) -> str:
        """A digest of every worker's whole final state (parameters, buffers, optimizer
        state, progress): two runs ended bit-identical exactly when their digests are equal
        (up to XXH3's 2^-64 per tensor) -- a run that recovered from failures, and the same
        run without them, say.

        Raises:
            KeyError: if states were not collected (``Trainer(collect_states=False)``).
        """
        if not self.states:
            raise KeyError("no final states: Trainer(collect_states=False)")
        h = xxhash.xxh3_64()

        def walk(obj: Any) -> None:
            if isinstance(obj, torch.Tensor):
                h.update(f"{obj.dtype}{tuple(obj.shape)}".encode())
                h.update(digest(obj).encode())
            elif isinstance(obj, dict):
                for key in sorted(obj, key=str):
                    h.update(repr(key).encode())
                    walk(obj[key])
            elif isinstance(obj, list | tuple):
                for item in obj:
                    walk(item)
            else:
                h.update(repr(obj).encode())

        walk(self.states)
        return h.hexdigest()
