"""The recovery planner: a pure function from what was lost and what survives to a plan.

``plan(topology, lost, redundancy, policy) -> RecoveryPlan`` chooses, for every lost unit,
the first source that exists in the recovery hierarchy (docs/DESIGN.md). The runtime only
executes plans; it decides nothing the planner did not decide. Invariants, property-tested
in tests/test_planner.py:

- every lost worker gets exactly one action, and no live worker gets one (except in a
  plan that restores everyone, like ``restart``);
- every source is alive and is not itself being rebuilt by the same plan;
- ``RedundancyExhausted`` is raised if and only if some unit has no allowed source.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from parallelism.topology import Topology
from recovery.errors import RedundancyExhausted
from recovery.policy import RecoveryPolicy

REPLICA_COPY = "replica_copy"
RESTART = "restart"


@dataclass(frozen=True)
class Redundancy:
    """What survives a failure."""

    alive: Mapping[int, int]
    """Rank -> the number of steps that live worker has committed."""
    checkpoint_steps: tuple[int, ...] = ()
    """Steps at which a complete checkpoint exists (``restart`` only)."""


@dataclass(frozen=True)
class Action:
    """Rebuild worker ``rank`` with ``strategy`` from ``sources`` (global ranks)."""

    rank: int
    strategy: str
    sources: tuple[int, ...] = ()


@dataclass(frozen=True)
class RecoveryPlan:
    """What to do: one action per rebuilt worker, and the step training resumes at."""

    actions: tuple[Action, ...]
    resume_step: int
    lost: tuple[int, ...] = field(default=())

    @property
    def strategy(self) -> str:
        """The strategies used, e.g. ``"replica_copy"``."""
        return "+".join(sorted({a.strategy for a in self.actions})) or "none"

    def describe(self, topology: Topology) -> str:
        lines = [f"recovery plan: resume at step {self.resume_step}"]
        for a in self.actions:
            src = ", ".join(str(topology.worker(s)) for s in a.sources) or "-"
            lines.append(f"  {topology.worker(a.rank)} <- {a.strategy} from {src}")
        return "\n".join(lines)


def plan(
    topology: Topology,
    lost: Collection[int],
    redundancy: Redundancy,
    policy: RecoveryPolicy,
) -> RecoveryPlan:
    """Plan the recovery of the ``lost`` ranks.

    Raises:
        ValueError: if ``lost`` and ``redundancy.alive`` overlap or do not cover the job.
        RedundancyExhausted: naming each stage whose state has no allowed source.
    """
    lost_set = set(lost)
    alive = dict(redundancy.alive)
    everyone = set(range(topology.world_size))
    if lost_set & alive.keys():
        raise ValueError(f"ranks {sorted(lost_set & alive.keys())} are both lost and alive")
    if lost_set | alive.keys() != everyone:
        raise ValueError(
            f"ranks {sorted(everyone - lost_set - alive.keys())} are neither lost nor alive"
        )
    if not lost_set:
        return RecoveryPlan(actions=(), resume_step=max(alive.values(), default=0))
    if policy.strategy == RESTART:
        return _restart(topology, lost_set, redundancy)

    step = max(alive.values(), default=0)
    current = {rank for rank, s in alive.items() if s == step}
    actions: list[Action] = []
    exhausted: list[str] = []
    for stage in range(topology.stages):
        group = topology.stage_group(stage)
        targets = sorted(r for r in group if r in lost_set)
        if not targets:
            continue
        sources = sorted(r for r in group if r in current)
        if not sources:
            exhausted.append(
                f"stage {stage} lost all {topology.replicas} replica(s) "
                f"({', '.join(str(topology.worker(r)) for r in targets)})"
            )
            continue
        # Spread the copies over the live replicas so no single source serialises them.
        actions.extend(
            Action(rank=t, strategy=REPLICA_COPY, sources=(sources[i % len(sources)],))
            for i, t in enumerate(targets)
        )
    if exhausted:
        raise RedundancyExhausted(
            "no exact source for lost state: "
            + "; ".join(exhausted)
            + ". The policy allows no other recovery; run with replicas >= 2 and lose fewer "
            "workers per stage, or allow snapshots/approximate recovery."
        )
    return RecoveryPlan(actions=tuple(actions), resume_step=step, lost=tuple(sorted(lost_set)))


def _restart(topology: Topology, lost: set[int], redundancy: Redundancy) -> RecoveryPlan:
    """Everyone restarts from the newest complete checkpoint (step 0: the initial state)."""
    resume = max(redundancy.checkpoint_steps, default=0)
    actions = tuple(Action(rank=r, strategy=RESTART) for r in range(topology.world_size))
    return RecoveryPlan(actions=actions, resume_step=resume, lost=tuple(sorted(lost)))
