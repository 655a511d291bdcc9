"""The peer-memory snapshot tier: packed states held in a buddy's memory for a few steps.

Every ``snapshots.peer_every`` steps each worker packs its state (`pack_state`), keeps that copy
itself and sends it to its buddy (`buddy_of`), which holds it in `PeerSnapshots`. A
rollback to step S needs every rank's state at S somewhere alive (`peer_rollback_step`):
survivors use their own copies, dead workers' replacements get theirs back from the
buddy. It survives any failure that does not take a worker and its buddy together. See
[Note: snapshot consistency] in ``recovery/snapshots/__init__.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from parallelism.checks import check_index, check_positive_int
from recovery.snapshots.packing import PackedState

__all__ = ["PeerSnapshots", "peer_rollback_step"]


class PeerSnapshots:
    """The packed states one worker holds: its own and its ward's, for a few steps.

    Keeps at most ``keep`` steps (default 2: the newest consistent snapshot survives
    while the next one is being taken); putting a newer step evicts the oldest. Once the
    controller knows a step is held everywhere, `drop_before` frees the older ones.
    Thread-safe: the exchange may run beside training.

    Raises:
        ValueError: if ``keep`` is not a positive integer.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = check_positive_int("keep", keep)
        self._held: dict[int, dict[int, PackedState]] = {}
        self._lock = threading.Lock()

    def put(self, step: int, rank: int, packed: PackedState) -> list[int]:
        """Hold rank ``rank``'s state at ``step``. Returns the steps evicted to make room.

        Raises:
            ValueError: if ``packed`` is of another step, or ``step`` is older than every
                held step while ``keep`` are held (it would be evicted at once).
        """
        check_index("step", step)
        check_index("rank", rank)
        if packed.step != step:
            raise ValueError(f"packed state is of step {packed.step}, not {step}")
        with self._lock:
            evicted = []
            if step not in self._held:
                if len(self._held) >= self.keep and step < min(self._held):
                    raise ValueError(
                        f"step {step} is older than every held step {sorted(self._held)}; "
                        "after a rollback, discard_after(rollback step) first"
                    )
                while len(self._held) >= self.keep:
                    oldest = min(self._held)
                    del self._held[oldest]
                    evicted.append(oldest)
            self._held.setdefault(step, {})[rank] = packed
            return evicted

    def get(self, step: int, rank: int) -> PackedState:
        """Rank ``rank``'s state at ``step``.

        Raises:
            KeyError: if it is not held here.
        """
        with self._lock:
            try:
                return self._held[step][rank]
            except KeyError:
                raise KeyError(
                    f"no peer snapshot of rank {rank} at step {step} here "
                    f"(held: {self._describe()})"
                ) from None

    def steps(self, rank: int | None = None) -> list[int]:
        """Steps held (for ``rank`` only, if given), newest first."""
        with self._lock:
            return sorted(
                (s for s, ranks in self._held.items() if rank is None or rank in ranks),
                reverse=True,
            )

    def holdings(self) -> dict[int, frozenset[int]]:
        """For each rank held here, the steps held: what `peer_rollback_step` needs."""
        with self._lock:
            out: dict[int, set[int]] = {}
            for step, ranks in self._held.items():
                for rank in ranks:
                    out.setdefault(rank, set()).add(step)
            return {rank: frozenset(steps) for rank, steps in out.items()}

    def drop_before(self, step: int) -> list[int]:
        """Free every step older than ``step``. Returns the steps dropped."""
        with self._lock:
            dropped = sorted(s for s in self._held if s < step)
            for s in dropped:
                del self._held[s]
            return dropped

    def discard_after(self, step: int) -> list[int]:
        """Drop every step newer than ``step`` (after a rollback to it; see
        [Note: snapshot consistency]). Returns the steps dropped."""
        with self._lock:
            dropped = sorted(s for s in self._held if s > step)
            for s in dropped:
                del self._held[s]
            return dropped

    def nbytes(self) -> int:
        """Bytes of the packed states held."""
        with self._lock:
            return sum(p.nbytes for ranks in self._held.values() for p in ranks.values())

    def _describe(self) -> str:
        return (
            ", ".join(f"step {s}: ranks {sorted(r)}" for s, r in sorted(self._held.items()))
            or "nothing"
        )


def peer_rollback_step(
    alive: set[int],
    held: Mapping[int, Mapping[int, Iterable[int]]],
    own: Mapping[int, Iterable[int]],
    world_size: int,
    stand_ins: Mapping[int, Iterable[int]] | None = None,
) -> int | None:
    """The newest step S at which every rank's state survives somewhere alive, or None.

    Rank ``r``'s state at S survives if ``r`` is alive and kept its own copy
    (``S in own[r]``) or some live holder ``h`` holds it (``S in held[h][r]``) -- or, with
    ``stand_ins``, if the state at S of one of ``stand_ins[r]`` survives: ranks whose state
    is bit-identical to ``r``'s at every step (the replicas of its stage, see [Note:
    buffers are state] in parallelism/buffers.py), so that any one's snapshot restores any
    other. Entries of dead workers are ignored. Survivors roll back from their own copies;
    each other rank receives one from a live holder.

    Raises:
        ValueError: for a world size below 1 or a rank outside ``0..world_size-1``.
    """
    check_positive_int("world_size", world_size)
    ranks = set(range(world_size))
    mentioned = set(alive) | set(held) | set(own)
    for ward_steps in held.values():
        mentioned |= set(ward_steps)
    for rank, others in (stand_ins or {}).items():
        mentioned |= {rank, *others}
    if not mentioned <= ranks:
        raise ValueError(f"ranks {sorted(mentioned - ranks)} outside a job of {world_size}")
    available: dict[int, set[int]] = {r: set() for r in ranks}
    for rank in alive:
        available[rank] |= set(own.get(rank, ()))
    for holder, wards in held.items():
        if holder in alive:
            for ward, steps in wards.items():
                available[ward] |= set(steps)
    if stand_ins:
        available = {
            r: available[r].union(*(available[o] for o in stand_ins.get(r, ()))) for r in ranks
        }
    common = set.intersection(*available.values())
    return max(common, default=None)
