"""Who runs where, and the generations they meet in.

`Membership` owns the job's placement (rank -> node, and each worker's host for its
transport), the nodes lost so far, the hot spares, and the process-group generations:
every generation meets on a fresh key prefix of the controller's store, with the buddy
ring of that placement. The controller asks it to start workers, to find nodes for
replacements, and to form the next generation; it decides nothing about recovery.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from parallelism.comm import Rendezvous, host_store
from parallelism.spec import TrainSpec
from parallelism.topology import Topology
from recovery.errors import PlacementFailed
from recovery.groups.group import WorkerGroup, require, seconds
from recovery.groups.placement import place, replacement_node
from recovery.policy import RecoveryPolicy
from recovery.runtime.detection import abort_pending, settle
from recovery.runtime.elastic import shares
from recovery.runtime.layouts import StateLayout
from recovery.runtime.ledger import RedundancyLedger
from recovery.snapshots import buddies
from recovery.worker import StageWorker, StepReport

__all__ = ["SLOW_NODE_STRAGGLERS", "Membership"]

log = logging.getLogger("checkfree")

SLOW_NODE_STRAGGLERS = 2
"""A node on which this many stragglers were found takes no more replacements or spares
while another node can (one straggler may be the worker's own bad luck -- a GC pause, a
noisy process -- two on one node point at the node; see [Note: stragglers] in
recovery/runtime/stragglers.py)."""


class Membership:
    """The workers' placement, spares and generations (see the module docstring).

    Args:
        host: the address the controller's store listens on (and workers dial).
        backend: the workers' process-group backend.
        device: the workers' compute device, as asked for (None: the backend's own).
    """

    def __init__(
        self,
        group: WorkerGroup,
        spec: TrainSpec,
        topology: Topology,
        policy: RecoveryPolicy,
        layout: StateLayout,
        ledger: RedundancyLedger,
        *,
        host: str,
        backend: str,
        device: str | None = None,
    ) -> None:
        self.group = group
        self.spec = spec
        self.topology = topology
        self.policy = policy
        self.layout = layout
        self.ledger = ledger
        self.host = host
        self.backend = backend
        self.device = device
        """The compute device asked for (parallelism/devices.py; None: the backend's own)."""
        self.store: Any = None
        """The current generation's store (workers leave fault times in it)."""
        self.generation = -1
        self.job_nodes = group.nodes()
        self.lost_nodes: set[str] = set()
        self.straggler_nodes: Counter[str] = Counter()
        """Per node, the stragglers found on it (`note_stragglers`)."""
        self.assignment: dict[int, str] = place(topology, self.job_nodes)
        """Rank -> the node its worker runs on (as started)."""
        self.hosts: dict[int, str] = {}
        self.missing: set[int] = set()
        """Ranks a shrink left out: no worker, not in the generation (see [Note: elastic
        shrink] in recovery/runtime/elastic.py)."""

    def start_job(self) -> None:
        """Start the policy's hot spares and every worker (reusing parked ones), and wait
        for the spares: a spare still importing torch is no spare.

        Raises:
            RecoveryError: if the job's workers cannot be started or set up.
        """
        spares = self.policy.hot_spares
        self.add_spares(spares)
        self.start(dict(self.assignment), parked=True, what="start workers")
        ready = self.group.await_spares(self.policy.timeouts.start, self.policy.timeouts.replace)
        if ready < spares:
            log.warning("%d hot spare(s) failed to start; continuing without them", spares - ready)

    def leave_generation(
        self, lost: set[int], blanks: Collection[int] = ()
    ) -> tuple[set[int], set[int], dict[int, StepReport]]:
        """Kill the lost workers -- but the ``blanks`` (lost ranks whose live worker holds
        nothing yet, see [Note: live workers are kept]) -- and make every other live worker
        abandon the step and leave the generation.

        Returns the lost ranks (grown by anyone who died or did not answer meanwhile, who
        is killed too), the blanks still alive, and the survivors' reports.
        """
        keep = set(blanks) & lost
        self.group.kill(lost - keep)
        survivors = [r for r in self.group.ranks() if r not in lost]
        short = {self.topology.worker(r).stage for r in lost}  # their replicas may be asked
        prepared = self.group.call(
            StageWorker.prepare_recovery,
            [*survivors, *sorted(keep)],
            lambda r: (
                r not in keep and self.topology.worker(r).stage in short,
                self.policy.timeouts.within("control"),
            ),
            timeout=self.policy.timeouts.control,
        )
        gone = set(prepared.lost)
        self.group.kill(gone)
        lost = lost | gone
        reports = {r: report for r, report in prepared.results.items() if r not in lost}
        return lost, keep - gone, reports

    def renew(self, ranks: set[int]) -> set[int]:
        """Set live workers up afresh for their ranks (blanks reused: no process started).
        Returns those set up; the others are killed.

        Raises:
            Exception: the original error of a worker whose own code raised.
        """
        if not ranks:
            return set()
        built = self.group.call(
            StageWorker.setup,
            sorted(ranks),
            lambda rank: self.layout.setup_args(rank, self.backend, self.device),
            timeout=self.policy.timeouts.start,
        )
        failed = set(built.lost) | {rank for rank, _ in built.broken.values()}
        self.group.kill(failed)
        return set(built.results) - failed

    def live_nodes(self) -> list[str]:
        """The job's nodes not lost nor avoided for stragglers (those not lost if every one
        is avoided; all of them if every one was lost: Ray may have more)."""
        return _usable(self.job_nodes, self.lost_nodes, self.slow_nodes())

    def slow_nodes(self) -> set[str]:
        """Nodes avoided for placement: `SLOW_NODE_STRAGGLERS` stragglers were found there."""
        return {n for n, count in self.straggler_nodes.items() if count >= SLOW_NODE_STRAGGLERS}

    def note_stragglers(self, ranks: Iterable[int]) -> None:
        """Book stragglers found among ``ranks``' workers against their nodes."""
        for rank in ranks:
            node = self.assignment.get(rank)
            if node is None:
                continue
            self.straggler_nodes[node] += 1
            if self.straggler_nodes[node] == SLOW_NODE_STRAGGLERS:
                log.warning(
                    "node %s: %d stragglers found there; no replacement or spare goes there "
                    "while another node can take it",
                    node,
                    SLOW_NODE_STRAGGLERS,
                )

    def lose_node(self, node: str) -> list[int]:
        """Book ``node`` as lost; returns the ranks that ran on it."""
        self.lost_nodes.add(node)
        return [rank for rank, on in self.assignment.items() if on == node]

    def on_lost_node(self, ranks: Collection[int]) -> bool:
        """Whether any of ``ranks`` ran on a lost node."""
        return any(self.assignment.get(r) in self.lost_nodes for r in ranks)

    def present(self) -> list[int]:
        """The ranks of the current generation: all of them, less the missing."""
        return [r for r in range(self.topology.world_size) if r not in self.missing]

    def warm_placement(self, ranks: Collection[int]) -> dict[int, str]:
        """Those of ``ranks`` that a spare ready now can take -> the spare's node: where
        `replacements` would put them if a spare waits there, else on any ready spare left
        (an elastic job: a replacement on a node that holds another replica of its stage
        beats training on without it)."""
        ready = self.group.ready_spare_nodes()
        if not ready:
            return {}
        budget = Counter(ready)
        warm: dict[int, str] = {}
        for rank, node in sorted(self.replacements(ranks, ready).items()):
            if budget[node] > 0:
                budget[node] -= 1
                warm[rank] = node
        for rank in sorted(set(ranks) - set(warm)):
            left = next((n for n in ready if budget[n] > 0), None)
            if left is None:
                break
            budget[left] -= 1
            warm[rank] = left
        return warm

    def replacements(
        self, ranks: Collection[int], spare_nodes: Collection[str] | None = None
    ) -> dict[int, str]:
        """A node for each rank to rebuild, keeping replicas of a stage apart and using the
        hot spares (``spare_nodes``; default every spare, ready or not) where that rule
        allows (a spare is only taken on its own node)."""
        nodes = _usable(self.group.nodes(), self.lost_nodes, self.slow_nodes())
        if spare_nodes is None:
            spare_nodes = self.group.spare_nodes()
        spares = Counter(n for n in spare_nodes if n in nodes)
        placement: dict[int, str] = {}
        planned = dict(self.assignment)
        for rank in sorted(ranks):
            node = replacement_node(self.topology, rank, planned, nodes, spares)
            placement[rank] = planned[rank] = node
            spares[node] -= 1
        return placement

    def start(
        self, placement: dict[int, str], *, what: str, spares: bool = False, parked: bool = False
    ) -> set[int]:
        """Start workers for ``placement`` and set them up. Returns the ranks that got a
        warm worker (a hot spare, or one parked by an earlier job).

        Raises:
            PlacementFailed: naming each worker that found no room within
                ``timeouts.replace``, and why.
            RecoveryInterrupted: naming ``what`` failed, if a worker died or could not be
                started or set up.
        """
        timeouts = self.policy.timeouts
        started, warm = self.group.start(
            placement,
            timeout=timeouts.start,
            place_timeout=timeouts.replace,
            spares=spares,
            parked=parked,
        )
        if started.unplaced:
            raise PlacementFailed(
                f"could not {what}: {len(started.unplaced)} worker(s) found no room "
                f"(timeouts.replace={seconds(timeouts.replace):g} s): "
                + "; ".join(
                    f"worker {self.topology.worker(rank)}: {why}"
                    for rank, why in sorted(started.unplaced.items())
                )
                + ". Add nodes or free their resources, ask for less "
                "(Trainer(worker_resources=...)), or wait longer (timeouts.replace)",
                unplaced=started.unplaced,
            )
        require(started, what)
        for rank, info in started.results.items():
            self.assignment[rank] = info.node_id or placement[rank]
            self.hosts[rank] = info.host
        built = self.group.call(
            StageWorker.setup,
            placement,
            lambda rank: self.layout.setup_args(rank, self.backend, self.device),
            timeout=self.policy.timeouts.start,
        )
        require(built, "build stages")
        return warm

    def add_spares(self, count: int, *, anywhere: bool = False) -> None:
        """Start ``count`` more hot spares, warming up, each on the live node that holds the
        fewest workers and spares: a spare can stand in only for a worker whose stage has
        no other replica on its node, so an idle node's spare can replace anyone.
        ``anywhere``: wherever the scheduler finds room, now or later (a shrunk job's
        replacements: a node that joins later takes them)."""
        if anywhere:
            warm = (StageWorker.warm, (self.spec, self.topology, self.backend, self.device))
            self.group.add_spares([""] * max(0, count), lambda: warm)
            return
        nodes = self.live_nodes()
        load = Counter(n for n in self.assignment.values() if n in nodes)
        load.update(n for n in self.group.spare_nodes() if n in nodes)
        picks = []
        for _ in range(max(0, count)):
            node = min(nodes, key=lambda n: (load[n], nodes.index(n)))
            picks.append(node)
            load[node] += 1
        warm = (StageWorker.warm, (self.spec, self.topology, self.backend, self.device))
        self.group.add_spares(picks, lambda: warm)

    def form_generation(self) -> float:
        """Tear down the current process groups everywhere and form the next generation.

        Returns the seconds it took. Every generation meets on a store of its own, hosted
        here, so nothing from an older generation is ever read again. A formation that
        cannot complete (a worker died before or while joining) is cut short: the joiners
        still pending are told to abort this generation, and give up at once wherever
        they are -- not yet begun, connecting to the store, or connecting Gloo pairs.

        Raises:
            RecoveryInterrupted: naming the workers lost or broken while joining.
        """
        start = time.perf_counter()
        self.generation += 1
        timeout = self.policy.timeouts.join
        store: Any = host_store(self.host)
        rendezvous = Rendezvous(
            self.host,
            store.port,
            f"gen{self.generation}",
            seconds(timeout),
            job=self.group.job,
            collective_s=seconds(self.policy.timeouts.backend_timeout),
        )
        whole = not self.missing  # a shrunk generation takes no snapshots (elastic.py)
        peer = whole and bool(self.policy.snapshots.peer_every) and self.topology.world_size > 1
        mirrors = self.layout.mirrors_on_ring and self.topology.world_size > 1
        ring = buddies(self.topology, self.assignment) if peer or mirrors else {}
        self.ledger.ring = ring
        wards = {buddy: ward for ward, buddy in ring.items()}
        members = None if whole else tuple(self.present())
        roles = shares(self.topology, self.missing)
        calls = {
            rank: self.group.submit(
                rank,
                StageWorker.join,
                self.generation,
                rendezvous,
                self.hosts.get(rank, "127.0.0.1"),
                peer,
                ring.get(rank),
                wards.get(rank),
                members,
                roles.get(rank),
            )
            for rank in self.present()
        }

        # At the first failure (a joiner died), the joiners still pending are told to give
        # up this generation (see [Note: abandoning a formation] in parallelism/comm/groups.py):
        # by number, since the abort can overtake the join it is meant for. The store
        # stays up until every call is back -- a joiner that has yet to connect to it
        # connects, sees the abort and returns at once -- and is dropped after, which
        # frees the Gloo constructors the joiners abandoned on their helper threads.
        joined = settle(
            self.group,
            calls,
            seconds(timeout) + 10,
            on_failure=abort_pending(self.group, self.generation),
        )
        if not joined.ok:
            store = None
        require(joined, f"form generation {self.generation}")
        self.store = store
        return time.perf_counter() - start

    def close(self) -> None:
        """Drop the store (workers still connected to it see it go)."""
        self.store = None


def _usable(nodes: Sequence[str], lost: Collection[str], slow: Collection[str]) -> list[str]:
    """``nodes`` less the lost and the slow ones; less the lost only if that leaves none;
    all of them if every one is lost."""
    alive = [n for n in nodes if n not in lost]
    return [n for n in alive if n not in slow] or alive or list(nodes)
