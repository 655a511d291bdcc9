"""Injected faults as the controller arms them, step by step.

A `FailureSchedule` says what strikes when; `InjectedFaults` turns it into what each
worker is handed with its step: a `KillNode` becomes a `Kill` of every worker on that
node (and the node is booked lost), and a fault is spent once it has struck, so a step
re-run after a recovery does not fail again. Workers leave the wall-clock time a fault
struck in the generation's store (`fault_time` reads it), which is where a recovery's
``detect`` time is measured from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch.distributed as dist

from parallelism.topology import Topology
from recovery.faults.exits import expect_exit
from recovery.faults.schedule import BitFlip, FailureSchedule, Fault, Kill, KillNode, WorkerFault

__all__ = ["Armed", "InjectedFaults", "fault_time"]

Armed = dict[int, tuple[Fault, ...]]
"""The faults handed to each rank with one step."""


class _Process(Protocol):
    @property
    def pid(self) -> int: ...


class _Group(Protocol):
    def info(self, rank: int) -> _Process: ...


class _Membership(Protocol):
    """What arming a `KillNode` reads and books of the job's membership
    (`recovery.runtime.membership.Membership`, which this layer does not import)."""

    @property
    def job_nodes(self) -> Sequence[str]: ...

    @property
    def group(self) -> _Group: ...

    def lose_node(self, node: str) -> Iterable[int]: ...


class InjectedFaults:
    """The schedule's faults, armed for the step they strike at; each fires once."""

    def __init__(self, schedule: FailureSchedule, topology: Topology) -> None:
        self.schedule = schedule
        self.topology = topology
        self._fired: set[Fault] = set()

    def check_nodes(self, nodes: int) -> None:
        """Raises ValueError for a `KillNode` of a node the job does not have."""
        for fault in self.schedule:
            if isinstance(fault, KillNode) and fault.node >= nodes:
                raise ValueError(f"{fault}: the job runs on {nodes} node(s)")

    def due(self, step: int) -> bool:
        """Whether a fault not yet spent strikes at ``step``."""
        return any(f.step == step and f not in self._fired for f in self.schedule)

    def arm(self, step: int, membership: _Membership) -> Armed:
        """The faults that strike at ``step``, per rank (a node's loss is booked now)."""
        out: dict[int, list[Fault]] = {}
        for fault in self.schedule:
            if fault.step != step or fault in self._fired:
                continue
            if isinstance(fault, KillNode):
                for rank in membership.lose_node(membership.job_nodes[fault.node]):
                    w = self.topology.worker(rank)
                    out.setdefault(rank, []).append(
                        Kill(step=step, stage=w.stage, replica=w.replica)
                    )
                self._fired.add(fault)
            elif isinstance(fault, WorkerFault):
                out.setdefault(self.topology.rank(fault.stage, fault.replica), []).append(fault)
                if isinstance(fault, BitFlip) and fault.in_flight:
                    self._fired.add(fault)  # delivered once; it strikes at a later send
        for rank, faults in out.items():
            if any(isinstance(f, Kill) for f in faults):
                with contextlib.suppress(KeyError):  # a rank without a worker dies anyway
                    expect_exit(membership.group.info(rank).pid, f"injected kill at step {step}")
        return {rank: tuple(faults) for rank, faults in out.items()}

    def spend(self, armed: Armed, ranks: Iterable[int] | None = None) -> None:
        """Mark the faults of ``ranks`` (default: all armed) as fired."""
        chosen = None if ranks is None else set(ranks)
        for rank, faults in armed.items():
            if chosen is None or rank in chosen:
                self._fired.update(faults)


def fault_time(store: Any, generation: int, ranks: Iterable[int]) -> float | None:
    """When an injected fault struck one of ``ranks`` in ``generation`` (None: no record)."""
    prefixed = dist.PrefixStore(f"gen{generation}", store)
    times = []
    for rank in ranks:
        key = f"fault/{rank}"
        with contextlib.suppress(Exception):
            if prefixed.check([key]):
                times.append(float(prefixed.get(key).decode()))
    return min(times) if times else None
