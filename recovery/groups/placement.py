"""Which Ray node each worker runs on: replicas of one stage on different nodes.

A node loss must never take a whole stage group, or the only exact source of that
stage's state would be gone with it. So pipeline replica ``r`` goes to node
``r mod N`` (a pipeline stays on one node, where its activation traffic is cheapest,
and the replicas of every stage land on ``min(R, N)`` different nodes). Replacements go
back to the dead worker's node if it is alive, else to the least-loaded node that holds
no other replica of the same stage. Pure functions, tested without Ray.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from parallelism.topology import Topology


def place(topology: Topology, nodes: Sequence[str]) -> dict[int, str]:
    """Assign every rank to a node.

    Raises:
        ValueError: if ``nodes`` is empty.
    """
    if not nodes:
        raise ValueError("no alive Ray node to place workers on")
    ordered = sorted(nodes)
    return {
        rank: ordered[topology.worker(rank).replica % len(ordered)]
        for rank in range(topology.world_size)
    }


def replacement_node(
    topology: Topology,
    rank: int,
    assignment: Mapping[int, str],
    alive: Sequence[str],
    spares: Mapping[str, int] | None = None,
) -> str:
    """The node on which to start the replacement of ``rank``.

    ``assignment`` maps every rank to its current (or last) node; ``spares`` counts the
    hot spares ready on each node. Never a node that holds another replica of the rank's
    stage while one without exists (a replica on every node is what survives a node
    loss). Among the allowed nodes: its previous node if a spare waits there, else a node
    with a spare (a warm start), else its previous node, else the least loaded.

    Raises:
        ValueError: if no node is alive.
    """
    if not alive:
        raise ValueError("no alive Ray node to start a replacement worker on")
    spares = spares or {}
    stage = topology.worker(rank).stage
    siblings = {assignment[r] for r in topology.stage_group(stage) if r != rank and r in assignment}
    candidates = [n for n in sorted(alive) if n not in siblings] or sorted(alive)
    load = Counter(node for r, node in assignment.items() if r != rank and node in alive)
    previous = assignment.get(rank)
    if previous in candidates and spares.get(previous, 0) > 0:
        return previous
    warm = [n for n in candidates if spares.get(n, 0) > 0]
    if warm:
        return min(warm, key=lambda n: (load[n], n))
    if previous is not None and previous in alive:
        return previous
    return min(candidates, key=lambda n: (load[n], n))
