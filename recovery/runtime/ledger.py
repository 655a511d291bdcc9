"""The ledger of redundancy: what copies of the job's state exist, and where.

The controller writes into it what workers report (peer snapshots held, durable writes
finished, checkpoints taken, the gradient norms CheckFree weighs with) and reads out of it
the planner's `Redundancy`. Nothing here talks to a worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from parallelism.topology import Topology
from recovery.planner import Redundancy
from recovery.strategies.checkfree import GradNormTracker
from recovery.worker import StepReport

__all__ = ["RedundancyLedger"]


@dataclass
class RedundancyLedger:
    """What redundancy exists, as last reported (see the module docstring)."""

    topology: Topology
    holdings: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    """Rank -> the peer snapshots it holds (rank -> steps); its own rank: its own copies."""
    checkpoint_steps: list[int] = field(default_factory=list)
    """Steps with a complete checkpoint (the restart baseline)."""
    durable_steps: list[int] = field(default_factory=list)
    """Steps with an intact, complete durable snapshot."""
    durable_writes: dict[int, set[int]] = field(default_factory=dict)
    """Durable snapshot step -> the ranks whose write of it has finished (not yet complete)."""
    durable_skipped: set[int] = field(default_factory=set)
    """Durable snapshot steps given up (some write or the commit failed): never complete."""
    ring: dict[int, int] = field(default_factory=dict)
    """Rank -> its buddy in the current generation: the holder of its peer snapshots and
    (embedding tables) of its shard mirror."""
    untrusted: set[int] = field(default_factory=set)
    """Live ranks whose state arrived corrupted at a receiver in the recovery under way: no
    source of it any more (see [Note: checked transfers] in recovery/transport/process_group.py)."""
    corrupted: list[tuple[int, int, tuple[str, ...], int | None]] = field(default_factory=list)
    """What arrived corrupted in the recovery under way, for its event: ``(target, source,
    tensors, snapshot step or None for a live state)``."""
    grad_norms: GradNormTracker = field(init=False)
    """Each stage's clipped gradient norm at the last committed step (CheckFree weights)."""

    def __post_init__(self) -> None:
        self.grad_norms = GradNormTracker(self.topology.stages)

    def note(self, reports: Mapping[int, StepReport]) -> list[int]:
        """Record what the workers hold. Returns the durable steps every rank has now
        finished writing (the caller marks them complete), oldest first."""
        for rank, report in reports.items():
            self.holdings[rank] = report.snapshots
            for step in report.durable_done:
                if step not in self.durable_skipped:
                    self.durable_writes.setdefault(step, set()).add(rank)
        done = [
            s for s, ranks in self.durable_writes.items() if len(ranks) == self.topology.world_size
        ]
        for step in done:
            del self.durable_writes[step]
        return sorted(done)

    def skip_durable(self, step: int) -> bool:
        """Give up the durable snapshot of ``step``: it will never be complete. Returns
        whether it was not given up already."""
        self.durable_writes.pop(step, None)
        if step in self.durable_skipped:
            return False
        self.durable_skipped.add(step)
        return True

    def note_norms(self, norms: Iterable[float]) -> None:
        """The committed step's per-stage clipped gradient norms."""
        for stage, norm in enumerate(norms):
            if math.isfinite(norm) and norm >= 0:
                self.grad_norms.record(stage, norm)
            else:
                self.forget_norm(stage)

    def forget_norm(self, stage: int) -> None:
        """A rebuilt stage has no gradient history yet (CheckFree then weighs uniformly)."""
        self.grad_norms.norms[stage] = None

    def forget(self, ranks: Iterable[int]) -> None:
        """Lost workers hold nothing any more."""
        for rank in ranks:
            self.holdings.pop(rank, None)

    def distrust(
        self, found: Iterable[tuple[int, int, tuple[str, ...]]], snapshot: int | None
    ) -> None:
        """Corrupted arrivals ``(target, source, tensors)``: of a live state (``snapshot``
        None), the source is no source again in this recovery; of a peer snapshot of step
        ``snapshot``, that copy (the holder's, or the target's own) is booked as gone."""
        for target, source, tensors in found:
            self.corrupted.append((target, source, tuple(tensors), snapshot))
            if snapshot is None:
                self.untrusted.add(source)
                continue
            steps = self.holdings.get(source, {}).get(target)
            if steps is not None and snapshot in steps:
                steps.remove(snapshot)

    def recovered(self) -> list[tuple[int, int, tuple[str, ...], int | None]]:
        """The recovery under way is done: trust every live rank again. Returns (and
        forgets) what arrived corrupted in it."""
        found, self.corrupted = self.corrupted, []
        self.untrusted = set()
        return found

    def rolled_back(self, step: int) -> None:
        """After a rollback to ``step``: nothing of the abandoned timeline remains."""
        self.durable_steps = [s for s in self.durable_steps if s <= step]
        self.durable_writes = {}
        self.durable_skipped = {s for s in self.durable_skipped if s <= step}
        for held in self.holdings.values():
            for rank in list(held):
                held[rank] = [s for s in held[rank] if s <= step]

    def redundancy(
        self,
        alive: Mapping[int, int],
        *,
        mirror_holder: Mapping[int, int] | None = None,
        mirror_stale: Mapping[int, bool] | None = None,
        pls: float = 0.0,
        stand_ins: Mapping[int, tuple[int, ...]] | None = None,
    ) -> Redundancy:
        """The planner's view: what survives among the ``alive`` ranks (rank -> step)."""
        own = {r: self.holdings.get(r, {}).get(r, []) for r in alive}
        held = {
            h: {w: steps for w, steps in self.holdings.get(h, {}).items() if w != h} for h in alive
        }
        return Redundancy(
            alive=dict(alive),
            checkpoint_steps=tuple(self.checkpoint_steps),
            peer_own=own,
            peer_held=held,
            durable_steps=tuple(self.durable_steps),
            mirror_holder=dict(mirror_holder or {}),
            mirror_stale=dict(mirror_stale or {}),
            pls=pls,
            untrusted=frozenset(self.untrusted & set(alive)),
            stand_ins=dict(stand_ins or {}),
        )
