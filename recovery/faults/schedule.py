"""What strikes when: `FailureSchedule` and the faults it lists, in code or in text form.

Deaths are real: a killed worker's process exits with SIGKILL at the chosen point inside
the chosen step, exactly as a crashed GPU host would vanish; a hung worker stops making
progress while its process stays alive. Each fault fires once: after the job recovers
and re-runs the step, the replacement worker is not killed again.

Text form (``scripts/train.py --failures``), faults separated by ``;``::

    kill:step=20,stage=1,replica=0[,at=mid_pipeline]
    hang:step=30,stage=2,replica=1
    nan:step=35,stage=0,replica=0   # a NaN written into the weights (silent data corruption)
    bitflip:step=35,stage=0,replica=2[,seed=0][,in_flight=1]  # one mantissa bit flipped: finite, wrong
    slow:step=10,stage=1,replica=0[,factor=3]   # from step 10 on, computes 3x slower
    killnode:step=40,node=1
    poisson:rate=0.02[,seed=0]      # per-worker-step probability, drawn once up front
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from parallelism.checks import check_index, check_number
from parallelism.topology import Topology


class KillPoint(str, enum.Enum):
    """Where inside a step a fault strikes.

    If the step is aborted (another worker failed first) before a kill's point inside
    phase one is reached, the kill strikes at the abort: the failures injected into one
    step strike together instead of one of them moving to the retried step.
    """

    BEFORE_FORWARD = "before_forward"
    """At the start of the step, before any microbatch."""
    MID_PIPELINE = "mid_pipeline"
    """Half-way through the stage's schedule, with microbatches in flight."""
    DURING_ALLREDUCE = "during_allreduce"
    """After the gradient all-reduce was started, before it completed."""
    BEFORE_COMMIT = "before_commit"
    """After reporting ready, when told to commit, before applying the step."""
    AFTER_COMMIT = "after_commit"
    """Right after applying the step, before acknowledging it."""


@dataclass(frozen=True, kw_only=True)
class _AtWorker:
    """A fault that strikes worker ``(stage, replica)`` at point ``at`` of step ``step``."""

    step: int
    stage: int
    replica: int
    at: KillPoint = KillPoint.BEFORE_FORWARD

    _word: ClassVar[str]
    """Its name in the text form."""

    def __post_init__(self) -> None:
        for name in ("step", "stage", "replica"):
            check_index(name, getattr(self, name))
        object.__setattr__(self, "at", _point(self.at))

    def __str__(self) -> str:
        return (
            f"{self._word}:step={self.step},stage={self.stage},replica={self.replica},"
            f"at={self.at.value}"
        )


@dataclass(frozen=True, kw_only=True)
class Kill(_AtWorker):
    """SIGKILL worker ``(stage, replica)`` at point ``at`` of step ``step``."""

    _word: ClassVar[str] = "kill"


@dataclass(frozen=True, kw_only=True)
class Hang(_AtWorker):
    """Make worker ``(stage, replica)`` stop making progress at ``at`` of step ``step``."""

    _word: ClassVar[str] = "hang"


@dataclass(frozen=True, kw_only=True)
class Corrupt(_AtWorker):
    """Silently corrupt worker ``(stage, replica)``'s weights with a NaN at ``at`` of step
    ``step`` -- what a bit flip in memory looks like to training."""

    _word: ClassVar[str] = "nan"


@dataclass(frozen=True, kw_only=True)
class BitFlip(_AtWorker):
    """Flip one mantissa bit of one element of one parameter or optimizer-state tensor of
    worker ``(stage, replica)`` at ``at`` of step ``step``: silent data corruption that
    leaves the value finite, so only a fingerprint vote can find it (see
    `recovery.integrity.fingerprint.flip_bit`). The tensor, element and bit are drawn from ``seed``,
    so a run is reproducible.

    ``in_flight``: the bit flips instead in the next state this worker sends to another
    (a recovery's transfer from it), after the digests it sends along were taken -- what a
    bad link does; the receiver finds it (see [Note: checked transfers] in
    recovery/transport/process_group.py). Armed at ``at`` of ``step``, it fires at the next
    such send."""

    seed: int = 0
    in_flight: bool = False

    _word: ClassVar[str] = "bitflip"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_index("seed", self.seed)
        if not isinstance(self.in_flight, bool):
            raise ValueError(f"in_flight must be True or False, got {self.in_flight!r}")

    def __str__(self) -> str:
        flight = ",in_flight=1" if self.in_flight else ""
        return f"{super().__str__()},seed={self.seed}{flight}"


@dataclass(frozen=True, kw_only=True)
class Slow(_AtWorker):
    """From ``at`` of step ``step`` on, worker ``(stage, replica)`` computes ``factor`` times
    slower: after each forward or backward pass it sleeps ``factor - 1`` times the pass's
    time (inside the pass's measured compute time, outside anything it holds). The worker
    stays slow until it is replaced: a straggler (see docs/stragglers.md)."""

    factor: float = 3.0

    _word: ClassVar[str] = "slow"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("factor", self.factor, minimum=1.0)

    def __str__(self) -> str:
        return f"{super().__str__()},factor={self.factor:g}"


@dataclass(frozen=True, kw_only=True)
class KillNode:
    """SIGKILL every worker on the job's ``node``-th Ray node (in node-id order) at step ``step``."""

    step: int
    node: int

    def __post_init__(self) -> None:
        check_index("step", self.step)
        check_index("node", self.node)

    def __str__(self) -> str:
        return f"killnode:step={self.step},node={self.node}"


Fault = Kill | Hang | Corrupt | BitFlip | Slow | KillNode
WorkerFault = Kill | Hang | Corrupt | BitFlip | Slow
"""Faults that strike one worker (delivered to it with the step)."""


def _flag(name: str, text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {text!r}")


def _point(value: object) -> KillPoint:
    try:
        return KillPoint(value)
    except ValueError:
        known = ", ".join(p.value for p in KillPoint)
        raise ValueError(f"unknown kill point {value!r}; choose one of {known}") from None


class FailureSchedule:
    """An ordered set of faults to inject.

    Raises:
        ValueError: for something that is not a fault.
    """

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        self.faults: tuple[Fault, ...] = tuple(faults)
        for fault in self.faults:
            if not isinstance(fault, Kill | Hang | Corrupt | BitFlip | Slow | KillNode):
                raise ValueError(
                    f"not a fault: {fault!r} (use Kill, Hang, Corrupt, BitFlip, Slow or KillNode)"
                )

    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults)

    def __len__(self) -> int:
        return len(self.faults)

    def __str__(self) -> str:
        return ";".join(str(f) for f in self.faults)

    def __repr__(self) -> str:
        return f"FailureSchedule({list(self.faults)!r})"

    def check(self, topology: Topology, steps: int | None = None) -> None:
        """Validate against a job.

        Raises:
            ValueError: naming a fault whose worker is outside ``topology`` or whose step
                is outside ``0..steps-1``.
        """
        for fault in self.faults:
            if steps is not None and fault.step >= steps:
                raise ValueError(f"{fault}: step {fault.step} is outside a job of {steps} steps")
            if isinstance(fault, WorkerFault) and (
                fault.stage >= topology.stages or fault.replica >= topology.replicas
            ):
                raise ValueError(
                    f"{fault}: worker ({fault.stage},{fault.replica}) is outside a {topology} job"
                )

    @classmethod
    def poisson(
        cls, topology: Topology, steps: int, rate: float, *, seed: int = 0
    ) -> FailureSchedule:
        """Kill each worker in each step independently with probability ``rate``.

        Kills land at a uniformly drawn point of the step. Drawn once, deterministically.

        Raises:
            ValueError: if ``rate`` is not in [0, 1].
        """
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"poisson rate must be a probability in [0, 1], got {rate}")
        rng = random.Random(seed)
        points = list(KillPoint)
        faults: list[Fault] = []
        for step in range(steps):
            for worker in topology.workers():
                if rng.random() < rate:
                    faults.append(
                        Kill(
                            step=step,
                            stage=worker.stage,
                            replica=worker.replica,
                            at=rng.choice(points),
                        )
                    )
        return cls(faults)

    @classmethod
    def parse(cls, text: str, *, topology: Topology, steps: int) -> FailureSchedule:
        """Read the text form (see the module docstring).

        Raises:
            ValueError: for an unknown fault kind or field, a field given twice, or a
                malformed value.
        """
        faults: list[Fault] = []
        for part in (p.strip() for p in text.split(";")):
            if not part or part == "none":
                continue
            kind, _, rest = part.partition(":")
            fields: dict[str, str] = {}
            for item in filter(None, (x.strip() for x in rest.split(","))):
                key, eq, value = item.partition("=")
                if not eq:
                    raise ValueError(f"malformed field {item!r} in {part!r}; expected key=value")
                if key.strip() in fields:  # which one was meant? Not for us to guess
                    raise ValueError(f"field {key.strip()!r} given twice in {part!r}")
                fields[key.strip()] = value.strip()
            try:
                if kind == "poisson":
                    faults.extend(
                        cls.poisson(
                            topology,
                            steps,
                            float(fields.pop("rate")),
                            seed=int(fields.pop("seed", "0")),
                        )
                    )
                elif kind in ("kill", "hang", "nan"):
                    types: dict[str, type[Kill] | type[Hang] | type[Corrupt]] = {
                        "kill": Kill,
                        "hang": Hang,
                        "nan": Corrupt,
                    }
                    fault_type = types[kind]
                    faults.append(
                        fault_type(
                            step=int(fields.pop("step")),
                            stage=int(fields.pop("stage")),
                            replica=int(fields.pop("replica", "0")),
                            at=_point(fields.pop("at", KillPoint.BEFORE_FORWARD.value)),
                        )
                    )
                elif kind == "bitflip":
                    faults.append(
                        BitFlip(
                            step=int(fields.pop("step")),
                            stage=int(fields.pop("stage")),
                            replica=int(fields.pop("replica", "0")),
                            at=_point(fields.pop("at", KillPoint.BEFORE_FORWARD.value)),
                            seed=int(fields.pop("seed", "0")),
                            in_flight=_flag("in_flight", fields.pop("in_flight", "0")),
                        )
                    )
                elif kind == "slow":
                    faults.append(
                        Slow(
                            step=int(fields.pop("step")),
                            stage=int(fields.pop("stage")),
                            replica=int(fields.pop("replica", "0")),
                            at=_point(fields.pop("at", KillPoint.BEFORE_FORWARD.value)),
                            factor=float(fields.pop("factor", "3")),
                        )
                    )
                elif kind == "killnode":
                    faults.append(
                        KillNode(step=int(fields.pop("step")), node=int(fields.pop("node")))
                    )
                else:
                    raise ValueError(
                        f"unknown fault kind {kind!r} in {part!r}; use kill, hang, nan, bitflip, slow, killnode or poisson"
                    )
            except KeyError as missing:
                raise ValueError(f"{part!r} needs a value for {missing}") from None
            except ValueError as exc:
                if str(exc).startswith(
                    (
                        "unknown",
                        "poisson",
                        "step",
                        "stage",
                        "replica",
                        "node",
                        "seed",
                        "in_flight",
                        "factor",
                    )
                ):
                    raise
                raise ValueError(f"malformed value in {part!r}: {exc}") from None
            if fields:
                raise ValueError(f"unknown field(s) {sorted(fields)} in {part!r}")
        schedule = cls(faults)
        schedule.check(topology, steps)
        return schedule
