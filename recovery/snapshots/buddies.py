"""Who holds whose peer snapshot: the buddy ring, chosen so one failure rarely takes both.

Rank ``ring[i]``'s packed state is held by ``ring[i + 1]`` (`buddy_ring`, `buddies`,
`buddy_of`). The ring is searched for the lowest cost (`_RingCost`): pairs of the same
stage or on a node that hosts a whole stage first, then same-node pairs. Pure and
deterministic: every process computes the same ring.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from parallelism.topology import Topology

__all__ = ["buddies", "buddy_of", "buddy_ring"]

_RESTARTS = 8  # random restarts of the buddy ring search, for jobs of up to
_RESTARTS_UP_TO = 64  # this many workers (where they are cheap)


def _same_node_critical(topology: Topology, node_of: Mapping[int, str]) -> set[str]:
    """Nodes that host every replica of some stage: losing one forces a rollback."""
    critical = set()
    for stage in range(topology.stages):
        nodes = {node_of[r] for r in topology.stage_group(stage)}
        if len(nodes) == 1:
            critical |= nodes
    return critical


class _RingCost:
    """Cost of a ring (see `buddy_ring`): the sum over consecutive pairs of
    ``(n + 1) * (same stage or same critical node) + same node``, so that any ring with
    fewer pairs of the first kind costs less."""

    def __init__(self, topology: Topology, node_of: Mapping[int, str]) -> None:
        n = topology.world_size
        critical = _same_node_critical(topology, node_of)
        self.stage = [topology.worker(r).stage for r in range(n)]
        self.node = [node_of[r] for r in range(n)]
        self.weight = n + 1
        self.critical = [self.node[r] in critical for r in range(n)]

    def pair(self, a: int, b: int) -> int:
        same_node = self.node[a] == self.node[b]
        severe = self.stage[a] == self.stage[b] or (same_node and self.critical[a])
        return severe * self.weight + same_node

    def total(self, ring: list[int]) -> int:
        return sum(self.pair(ring[i - 1], ring[i]) for i in range(len(ring)))

    def lower_bound(self) -> int:
        """No ring costs less: a group of ``m`` of the ``n`` ranks (a stage, a node) has at
        least ``2m - n`` of its members followed by a member."""
        n = len(self.stage)

        def excess(labels: Iterable[object]) -> int:
            counts: dict[object, int] = {}
            for label in labels:
                counts[label] = counts.get(label, 0) + 1
            return max(0, 2 * max(counts.values(), default=0) - n)

        critical = excess(node for node, c in zip(self.node, self.critical, strict=True) if c)
        return max(excess(self.stage), critical) * self.weight + excess(self.node)

    def greedy(self, first: int) -> list[int]:
        """Nearest-neighbour ring from ``first``: each next rank is a cheapest one, ties
        going to the node (then the stage) with the most ranks left, so that no node's
        ranks are left to the end to sit side by side."""
        n = len(self.stage)
        left = set(range(n)) - {first}
        per_node: dict[str, int] = {}
        per_stage: dict[int, int] = {}
        for r in left:
            per_node[self.node[r]] = per_node.get(self.node[r], 0) + 1
            per_stage[self.stage[r]] = per_stage.get(self.stage[r], 0) + 1
        ring = [first]
        while left:
            last = ring[-1]
            nxt = min(
                left,
                key=lambda r: (
                    self.pair(last, r),
                    -per_node[self.node[r]],
                    -per_stage[self.stage[r]],
                    r,
                ),
            )
            left.remove(nxt)
            per_node[self.node[nxt]] -= 1
            per_stage[self.stage[nxt]] -= 1
            ring.append(nxt)
        return ring

    def improve(self, ring: list[int]) -> list[int]:
        """Local search from ``ring``: while some move lowers the cost, apply it. Moves
        start at a costly pair: reverse a segment (2-opt) or swap one of its ranks. Each
        move lowers the (integer) cost, so the search ends."""
        n = len(ring)
        improved = True
        while improved:
            improved = False
            for e in range(n):
                if self.pair(ring[e], ring[(e + 1) % n]) and self._move(ring, e):
                    improved = True
        return ring

    def _move(self, ring: list[int], e: int) -> bool:
        """Apply one cost-lowering move at the costly pair ``(ring[e], ring[e+1])``."""
        n = len(ring)
        pair = self.pair
        a, b = ring[e], ring[(e + 1) % n]
        for f in range(n):  # 2-opt: reverse ring[e+1 .. f]
            c, d = ring[f], ring[(f + 1) % n]
            if f == e or pair(a, c) + pair(b, d) >= pair(a, b) + pair(c, d):
                continue
            i, j = (e + 1) % n, f
            if i <= j:
                ring[i : j + 1] = ring[i : j + 1][::-1]
            else:  # the segment wraps: reverse it in place through the seam
                seg = [ring[k % n] for k in range(i, j + n + 1)][::-1]
                for k, r in zip(range(i, j + n + 1), seg, strict=True):
                    ring[k % n] = r
            return True
        for i in (e, (e + 1) % n):  # swap an end of the costly pair with any rank
            for j in range(n):
                if j == i:
                    continue
                before = self._around(ring, (i, j))
                ring[i], ring[j] = ring[j], ring[i]
                if self._around(ring, (i, j)) < before:
                    return True
                ring[i], ring[j] = ring[j], ring[i]
        return False

    def _around(self, ring: list[int], positions: tuple[int, int]) -> int:
        """Cost of the pairs that touch ``positions``."""
        n = len(ring)
        edges = {(p - 1) % n for p in positions} | {p % n for p in positions}
        return sum(self.pair(ring[e], ring[(e + 1) % n]) for e in edges)


def buddy_ring(topology: Topology, node_of: Mapping[int, str]) -> tuple[int, ...]:
    """The ring of peer snapshots: rank ``ring[i]``'s state is held by ``ring[i + 1]``.

    The rule follows from what the peer tier must survive. A rollback is only needed
    when some stage has lost every replica (otherwise ``replica_copy`` rebuilds the lost
    workers exactly and no snapshot is read), so above all a buddy must not share with
    its ward (1) a stage -- the stage group's loss would take both -- or (2) a node that
    hosts every replica of some stage -- that node's loss forces a rollback and takes
    both. Among the rings with the fewest such pairs, it takes one with (3) the fewest
    same-node pairs, for failures that combine a node with more. So:

    - one node: the buddy is the next rank (a different stage whenever there are 2+);
    - ``place()``'s layout on 2+ nodes: buddies on other nodes and of other stages,
      except where node sizes make that impossible (one node holds more than half of
      the workers: the fewest same-node pairs possible), and with 2 stages on 2 nodes,
      where nodes and stages cannot both alternate and the ring keeps stages apart;
    - a stage on a single node (e.g. one replica): that node is avoided like a stage.

    The search is deterministic, the same in every process: three candidate orders
    (rank order, nodes interleaved, greedy) improved by 2-opt and swap moves, plus a few
    seeded restarts for jobs of up to 64 workers. It matched brute force on every job of
    up to 8 workers tried (tests/test_snapshots.py checks up to 6) and takes ~1 s for 256.

    Raises:
        ValueError: if ``node_of`` lacks some rank.
    """
    n = topology.world_size
    missing = [r for r in range(n) if r not in node_of]
    if missing:
        raise ValueError(f"node_of has no node for ranks {missing}")
    natural = list(range(n))
    if len({node_of[r] for r in natural}) == 1:
        return tuple(natural)
    cost = _RingCost(topology, node_of)
    groups: dict[str, list[int]] = {}
    for r in natural:
        groups.setdefault(node_of[r], []).append(r)
    by_size = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    ordered = [r for g in by_size for r in g]
    # Fill even positions, then odd ones: no two neighbours share a node unless one node
    # holds more than half of the ranks.
    interleaved = [0] * n
    positions = list(range(0, n, 2)) + list(range(1, n, 2))
    for pos, r in zip(positions, ordered, strict=True):
        interleaved[pos] = r
    candidates = (natural, interleaved, cost.greedy(0))
    best = min((cost.improve(c) for c in candidates), key=cost.total)
    shuffler = random.Random(0)  # fixed seed: every process computes the same ring
    bound = cost.lower_bound()
    for _ in range(_RESTARTS if n <= _RESTARTS_UP_TO else 0):
        if cost.total(best) <= bound:
            break
        candidate = cost.improve(shuffler.sample(natural, n))
        if cost.total(candidate) < cost.total(best):
            best = candidate
    return tuple(best)


def buddies(topology: Topology, node_of: Mapping[int, str]) -> dict[int, int]:
    """Every rank's buddy (the rank that holds its peer snapshot). See `buddy_ring`.

    Raises:
        ValueError: if ``node_of`` lacks some rank.
    """
    ring = buddy_ring(topology, node_of)
    return {ring[i]: ring[(i + 1) % len(ring)] for i in range(len(ring))}


def buddy_of(rank: int, topology: Topology, node_of: Mapping[int, str]) -> int:
    """The rank that holds ``rank``'s peer snapshot: the next one on `buddy_ring`.

    In a one-worker job that is the worker itself (nothing survives its loss).

    Raises:
        ValueError: if ``rank`` is outside the job or ``node_of`` lacks some rank.
    """
    topology.worker(rank)  # validates
    return buddies(topology, node_of)[rank]
