"""What each failure event leaves behind: lost stage groups, adjacency, lost snapshot tier."""

from __future__ import annotations

import itertools

import numpy as np

from simulations.layout import Job
from simulations.policy_models import EventFacts
from simulations.traces import FailureEvents

__all__ = ["classify_events"]


def classify_events(events: FailureEvents, job: Job, window_s: float) -> EventFacts:
    """What each failure event leaves behind when a killed worker stays down ``window_s``.

    Vectorised for events with no other event of their seed within the window (nearly
    all of them); the rest are resolved exactly, one by one.

    Raises:
        ValueError: if the events were drawn for another cluster, or ``window_s < 0``.
    """
    if events.cluster != job.cluster:
        raise ValueError(f"events were drawn for {events.cluster}, the job runs on {job.cluster}")
    if not window_s >= 0:
        raise ValueError(f"window_s must be >= 0, got {window_s!r}")
    s_count, r_count, tp = job.layout.pp, job.layout.dp, job.layout.tp
    gpn, nodes, off = job.gpus_per_node, job.cluster.nodes, job.partner_offset
    n = len(events)
    first, last = events.first_gpu, events.first_gpu + events.num_gpus - 1
    lo, hi = first // tp, last // tp
    host = events.component > 0
    nlo, nhi = first // gpn, last // gpn
    # Event i's window: the events of its seed from ``start[i]`` to i that struck within
    # ``(t_i - w, t_i]``; i itself always counts (its workers are down from its instant on).
    start = np.empty(n, dtype=np.int64)
    for a, b in itertools.pairwise(events.offsets.tolist()):
        t = events.time_s[a:b]
        start[a:b] = a + np.searchsorted(t, t - window_s, side="right")
    idx = np.arange(n)
    start = np.minimum(start, idx)
    alone = start == idx

    # One event alone: stage s is fully down iff every replica's worker r*S+s is in [lo, hi].
    top = np.minimum(s_count - 1, hi - (r_count - 1) * s_count)
    lost = np.where(lo < s_count, np.maximum(0, top - lo + 1), 0)
    edge = (lost > 0) & ((lo == 0) | (top == s_count - 1))
    adjacent = lost >= 2
    span = nhi - nlo
    tier_lost = host & ((off == 0) | (span >= off) | (span >= nodes - off))

    # Exhaustion needs R distinct replicas down; bound them by the replicas each window event touches.
    touched = np.concatenate([[0], np.cumsum(hi // s_count - lo // s_count + 1)])
    feasible = touched[idx + 1] - touched[start] >= r_count
    host_sum = np.concatenate([[0], np.cumsum(host)])
    slow_lost = feasible & ~alone
    slow_tier = host & (host_sum[idx + 1] - host_sum[start] >= 2)
    lost[~feasible] = 0
    edge &= feasible
    adjacent &= feasible
    for i in np.flatnonzero(slow_lost | slow_tier).tolist():
        window = range(int(start[i]), i + 1)
        if slow_lost[i]:
            down: set[int] = set()
            for j in window:
                down.update(range(int(lo[j]), int(hi[j]) + 1))
            per_stage: dict[int, int] = {}
            for w in down:
                per_stage[w % s_count] = per_stage.get(w % s_count, 0) + 1
            mine = {
                w % s_count
                for w in range(int(lo[i]), min(int(hi[i]), int(lo[i]) + s_count - 1) + 1)
            }
            gone = [s for s in mine if per_stage[s] == r_count]
            lost[i] = len(gone)
            edge[i] = any(s in (0, s_count - 1) for s in gone)
            adjacent[i] = any(
                per_stage.get(s - 1, 0) == r_count or per_stage.get(s + 1, 0) == r_count
                for s in gone
            )
        if slow_tier[i]:
            dead: set[int] = set()
            for j in window:
                if host[j]:
                    dead.update(range(int(nlo[j]), int(nhi[j]) + 1))
            tier_lost[i] = off == 0 or any(
                (v + off) % nodes in dead or (v - off) % nodes in dead
                for v in range(int(nlo[i]), int(nhi[i]) + 1)
            )
    return EventFacts(
        lost_stages=lost.astype(np.int64), adjacent=adjacent, edge=edge, tier_lost=tier_lost
    )
