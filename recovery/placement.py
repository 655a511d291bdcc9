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
) -> str:
    """The node on which to start the replacement of ``rank``.

    ``assignment`` maps every rank to its current (or last) node.

    Raises:
        ValueError: if no node is alive.
    """
    if not alive:
        raise ValueError("no alive Ray node to start a replacement worker on")
    previous = assignment.get(rank)
    if previous is not None and previous in alive:
        return previous
    stage = topology.worker(rank).stage
    siblings = {assignment[r] for r in topology.stage_group(stage) if r != rank and r in assignment}
    load = Counter(node for r, node in assignment.items() if r != rank and node in alive)
    candidates = [n for n in sorted(alive) if n not in siblings] or sorted(alive)
    return min(candidates, key=lambda n: (load[n], n))
