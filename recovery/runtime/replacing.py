"""REPLACING: workers for the ranks a recovery rebuilds, or an elastic job without them.

The blanks of an interrupted recovery are set up afresh where they live, new processes
are started for the others, and survivors restore in place -- except in the restart
baseline, where everyone goes and comes back cold. Whether to wait for new workers or
train on without them is `decisions.replacement`'s; this carries it out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from parallelism.topology import Topology
from recovery.errors import PlacementFailed
from recovery.groups.group import WorkerGroup
from recovery.names import Strategy
from recovery.policy import RecoveryPolicy
from recovery.runtime.decisions import Replace, replacement
from recovery.runtime.elastic import shrink_plan, shrinkable
from recovery.runtime.membership import Membership
from recovery.runtime.states import Recovery

__all__ = ["replace_lost"]

log = logging.getLogger("checkfree")


def replace_lost(
    rec: Recovery,
    group: WorkerGroup,
    members: Membership,
    topology: Topology,
    policy: RecoveryPolicy,
) -> Replace:
    """Bring back ``rec``'s lost ranks; returns what was done (`Replace.START`: every one
    has a worker now; `Replace.SHRINK`: some are left out, see [Note: elastic shrink]).

    Raises:
        PlacementFailed: no room for the new workers, and the job may not shrink.
        RecoveryInterrupted: a worker died meanwhile.
    """
    t0 = time.perf_counter()
    cold = rec.plan.strategy == Strategy.RESTART
    renewed: set[int] = set()
    if cold:
        rebuild = list(range(topology.world_size))
        group.kill(set(rec.alive) | rec.blanks)
    else:
        renewed = members.renew(rec.blanks)
        rebuild = sorted(rec.lost - renewed)
    can_shrink = shrinkable(topology, rec.plan, rec.lost)
    how = replacement(
        elastic=policy.elastic, shrinkable=can_shrink, cold=cold, to_start=bool(rebuild)
    )
    if how is Replace.SHRINK:  # a cold start would stall everyone
        warm = members.warm_placement(rebuild)
        return _shrink(
            rec, group, members, topology, policy, warm, "no warm spare is ready", t0, renewed
        )
    placement = members.replacements(rebuild)
    try:
        started = (
            members.start(placement, spares=not cold, what="start replacement workers")
            if placement
            else set()
        )
    except PlacementFailed as exc:  # no room
        how = replacement(
            elastic=policy.elastic, shrinkable=can_shrink, cold=cold, to_start=True, no_room=True
        )
        if how is Replace.SHRINK:
            return _shrink(rec, group, members, topology, policy, {}, str(exc), t0, renewed)
        why = f"{rec.failure.describe(topology)}\n{exc}"
        raise PlacementFailed(why, unplaced=exc.unplaced) from None
    rec.warm = started | renewed
    members.missing = set()
    rec.add_time("replace", t0)
    return Replace.START


def _shrink(
    rec: Recovery,
    group: WorkerGroup,
    members: Membership,
    topology: Topology,
    policy: RecoveryPolicy,
    warm: dict[int, str],
    why: str,
    since: float,
    renewed: Collection[int] = (),
) -> Replace:
    """Bring back the lost workers that have a ready spare (``warm``: rank -> the node of
    its spare) or a live worker set up afresh (``renewed``), train on without the others,
    and ask for their replacements as spares, placed wherever there is room, to grow back
    with (see [Note: elastic shrink])."""
    left_out = rec.lost - set(warm) - set(renewed)
    rec.warm = set(renewed)
    group.kill(left_out)
    back = sorted(warm)
    if back:
        placement = {rank: warm[rank] for rank in back}
        try:
            rec.warm |= members.start(placement, spares=True, what="start replacement workers")
        except PlacementFailed:  # the spares went meanwhile: leave those out too
            group.kill(back)
            left_out |= set(back)
    rec.plan = shrink_plan(rec.plan, left_out)
    members.missing = set(left_out)
    wanted = policy.hot_spares + len(left_out)
    members.add_spares(wanted - group.spare_count(), anywhere=True)
    if left_out:
        log.warning(
            "shrinking: training on without %s until their replacements are ready (%s)",
            ", ".join(str(topology.worker(r)) for r in sorted(left_out)),
            why.splitlines()[0][:300],
        )
    rec.add_time("replace", since)
    return Replace.SHRINK
