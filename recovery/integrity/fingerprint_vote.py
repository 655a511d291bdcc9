"""The fingerprint vote: which replicas of a stage hold corrupted state, and what to do.

Pure functions on fingerprints (`recovery.integrity.fingerprint`), shared by the runtime
and tests: ``vote(topology, fingerprints) -> Verdict`` compares each stage group's
fingerprints and names the odd ones out; `can_vote` says whether the odd ones can be
rebuilt from the majority. The planner turns a verdict into a `RecoveryPlan`
(`recovery.planner.corruption_plan`).

[Note: fingerprint vote]
Workers fingerprint their state at the end of phase one of every K-th step, after the
gradient all-reduce and before the commit, so the state fingerprinted at step ``d`` is
the state ``d`` steps committed. When the last check on which every stage group agreed
was at step ``c``, every replica was clean then (a flipped bit stays in the replica it
hit until that replica is rebuilt). A mismatch at ``d`` means some worker was corrupted
after its fingerprint at ``c``:

- ``d == c + 1`` and every mismatched stage has a strict majority: step ``c``'s gradients
  were computed before the corruption (the fingerprint is taken after the all-reduce), so
  only the odd workers' own state is wrong; step ``d``'s gradients may be wrong
  everywhere, but ``d`` is not committed. The minority is rebuilt from the majority
  (``replica_vote``, exact) and ``d`` is re-run.
- otherwise (K > 1, or no majority: two replicas, or a tie) the corrupted state may have
  reached the all-reduced gradients of a committed step, which every replica of every
  stage applied alike, invisibly to any vote. Everyone rolls back to the newest snapshot
  at or before ``c``, the last step known clean, and the checks go on from there.

A wrong gradient computed on one replica before the all-reduce (a flip in an activation
or a gradient buffer) reaches every replica the same way and is invisible to a vote; the
non-finite check still catches a corruption that turns into a NaN or an infinity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from parallelism.topology import Topology
from recovery.names import Strategy
from recovery.policy import RecoveryPolicy

__all__ = ["Verdict", "can_vote", "vote"]


@dataclass(frozen=True)
class Verdict:
    """What one round of fingerprints says."""

    mismatched: tuple[int, ...] = ()
    """Stages whose replicas disagree."""
    majority: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Mismatched stage -> the ranks of its strict majority (absent: no majority)."""
    suspects: tuple[int, ...] = ()
    """Ranks outside their stage's majority (only stages that have one)."""
    undecided: tuple[int, ...] = ()
    """Ranks of the mismatched stages that have no majority (any of them may be corrupted)."""
    tensors: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """Suspect rank -> the tensors whose digest differs from the majority's; undecided rank
    -> the tensors on which its stage group disagrees."""

    @property
    def agree(self) -> bool:
        return not self.mismatched

    @property
    def decisive(self) -> bool:
        """Whether every mismatched stage has a strict majority."""
        return all(stage in self.majority for stage in self.mismatched)

    def describe(self, topology: Topology) -> dict[int, str]:
        """Per rank, what the vote found (for a failure's errors)."""
        out = {}
        for rank in self.undecided:
            names = ", ".join(self.tensors.get(rank, ())) or "?"
            stage = topology.worker(rank).stage
            out[rank] = f"stage {stage}'s replicas disagree, with no majority, in: {names}"
        for rank in self.suspects:
            names = ", ".join(self.tensors.get(rank, ())) or "?"
            out[rank] = f"fingerprint differs from its stage group's majority in: {names}"
        return out


def vote(topology: Topology, fingerprints: Mapping[int, Mapping[str, str]]) -> Verdict:
    """Compare the fingerprints of each stage group (ranks that reported none are skipped).

    A strict majority of identical fingerprints is taken as the true state; with two
    replicas, or a tie, a mismatched stage has none.
    """
    mismatched: list[int] = []
    majority: dict[int, tuple[int, ...]] = {}
    suspects: list[int] = []
    undecided: list[int] = []
    tensors: dict[int, tuple[str, ...]] = {}
    for stage in range(topology.stages):
        ranks = [r for r in topology.stage_group(stage) if r in fingerprints]
        classes: dict[tuple[tuple[str, str], ...], list[int]] = {}
        for rank in ranks:
            classes.setdefault(tuple(sorted(fingerprints[rank].items())), []).append(rank)
        if len(classes) <= 1:
            continue
        mismatched.append(stage)
        biggest = max(classes.values(), key=len)
        if 2 * len(biggest) <= len(ranks):
            names = {n for r in ranks for n in fingerprints[r]}
            split = tuple(
                sorted(n for n in names if len({fingerprints[r].get(n) for r in ranks}) > 1)
            )
            undecided.extend(ranks)
            tensors.update({rank: split for rank in ranks})
            continue
        majority[stage] = tuple(biggest)
        truth = fingerprints[biggest[0]]
        for rank in ranks:
            if rank in biggest:
                continue
            suspects.append(rank)
            mine = fingerprints[rank]
            tensors[rank] = tuple(
                sorted(n for n in truth.keys() | mine.keys() if truth.get(n) != mine.get(n))
            )
    return Verdict(
        tuple(mismatched), majority, tuple(sorted(suspects)), tuple(sorted(undecided)), tensors
    )


def can_vote(verdict: Verdict, step: int, verified: int, policy: RecoveryPolicy) -> bool:
    """Whether the odd workers can be rebuilt from the majority without a rollback (see
    [Note: fingerprint vote]): a majority everywhere, and no step committed since the
    last agreeing check at ``verified`` that the corruption could have reached."""
    return (
        not verdict.agree
        and verdict.decisive
        and step - verified <= 1
        and policy.allows(Strategy.REPLICA_VOTE)
    )
