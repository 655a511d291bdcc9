"""Schedules as data: the actions a stage performs and the per-stage lists of them.

An `Action` is one op on one microbatch (``F3``, ``RF3<1``, ...); a `Schedule` holds each
stage's actions in order and one *route* per microbatch (the order in which it visits the
stages: `natural_routes`, or CheckFree+'s `swapped_routes`). Building one checks nothing
(see parallelism/schedule/validation.py); a broken one is reported as a `ScheduleError`
that prints the schedule's table with the offending actions marked.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass


class Op(str, enum.Enum):
    """What a stage does in one action (the value is the compact spelling)."""

    RECV_F = "RF"  # receive activation of a microbatch from its route predecessor (peer)
    FORWARD = "F"  # forward of a microbatch; on the route's last stage it also computes the loss
    SEND_F = "SF"  # send output activation to the route successor (peer)
    RECV_B = "RB"  # receive gradient w.r.t. our output from the route successor (peer)
    BACKWARD = "B"  # backward of a microbatch
    SEND_B = "SB"  # send gradient w.r.t. our input to the route predecessor (peer)

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_F, Op.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_F, Op.RECV_B)

    @property
    def kind(self) -> Op:
        """The compute op this action belongs to: ``F`` for RF/F/SF, ``B`` for RB/B/SB."""
        return Op.FORWARD if self in (Op.RECV_F, Op.FORWARD, Op.SEND_F) else Op.BACKWARD


_ACTION_RE = re.compile(r"^(?:(F|B)(\d+)|(RF|RB)(\d+)<(\d+)|(SF|SB)(\d+)>(\d+))$")


@dataclass(frozen=True)
class Action:
    """One step of one stage: an op on a microbatch, with the other stage for communication.

    Printed compactly, like torch pipelining's ``2F0``: ``F3``, ``B3``, ``RF3<1`` (receive
    the activation of microbatch 3 from stage 1), ``SF3>2``, ``RB3<2``, ``SB3>0``.

    Raises:
        ValueError: if ``microbatch`` is negative, or ``peer`` is given for ``F``/``B`` or
            missing (or negative) for a send or receive.
    """

    op: Op
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", Op(self.op))
        if isinstance(self.microbatch, bool) or not isinstance(self.microbatch, int):
            raise ValueError(f"Action microbatch must be an int, got {self.microbatch!r}")
        if self.microbatch < 0:
            raise ValueError(f"Action microbatch must be >= 0, got {self.microbatch}")
        if self.op.is_compute:
            if self.peer is not None:
                raise ValueError(f"{self.op.value} takes no peer, got peer={self.peer!r}")
        elif isinstance(self.peer, bool) or not isinstance(self.peer, int) or self.peer < 0:
            raise ValueError(f"{self.op.value} needs a peer stage >= 0, got {self.peer!r}")

    def __str__(self) -> str:
        if self.op.is_compute:
            return f"{self.op.value}{self.microbatch}"
        arrow = "<" if self.op.is_recv else ">"
        return f"{self.op.value}{self.microbatch}{arrow}{self.peer}"

    @classmethod
    def from_str(cls, text: str) -> Action:
        """Parse the compact form written by ``str(action)``.

        Raises:
            ValueError: if ``text`` is not of the form ``F3``, ``B3``, ``RF3<1``, ``RB3<1``,
                ``SF3>2`` or ``SB3>2``.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected e.g. 'F3', 'B3', 'RF3<1', 'SF3>2', "
                "'RB3<2' or 'SB3>0'"
            )
        g = match.groups()
        if g[0] is not None:
            return cls(Op(g[0]), int(g[1]))
        if g[2] is not None:
            return cls(Op(g[2]), int(g[3]), int(g[4]))
        return cls(Op(g[5]), int(g[6]), int(g[7]))


Route = tuple[int, ...]


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def natural_routes(num_stages: int, num_microbatches: int) -> tuple[Route, ...]:
    """Every microbatch visits the stages in order ``0, 1, ..., S-1``.

    Raises:
        ValueError: if either argument is not a positive integer.
    """
    _check_sizes(num_stages, num_microbatches)
    route = tuple(range(num_stages))
    return tuple(route for _ in range(num_microbatches))


def swapped_routes(num_stages: int, num_microbatches: int) -> tuple[Route, ...]:
    """CheckFree+ routes: odd microbatches swap the first two and the last two stages.

    Even microbatches take the natural route; for ``S=4`` odd ones take ``(1, 0, 3, 2)``,
    for ``S=6`` ``(1, 0, 2, 3, 5, 4)``. Stages 1 and ``S-2`` thereby learn to behave like
    the edge stages, so they can stand in for them after a failure.

    Raises:
        ValueError: if either argument is not a positive integer, or ``num_stages < 4``
            (the two swapped pairs would overlap).
    """
    _check_sizes(num_stages, num_microbatches)
    if num_stages < 4:
        raise ValueError(
            f"swapped (CheckFree+) routes need num_stages >= 4 so that the first and the last "
            f"pair of stages are distinct, got num_stages={num_stages}; use natural_routes"
        )
    natural = tuple(range(num_stages))
    swapped = (1, 0, *range(2, num_stages - 2), num_stages - 1, num_stages - 2)
    return tuple(swapped if m % 2 else natural for m in range(num_microbatches))


def _is_permutation(route: object, num_stages: int) -> bool:
    return (
        isinstance(route, (tuple, list))
        and all(isinstance(x, int) and not isinstance(x, bool) for x in route)
        and sorted(route) == list(range(num_stages))
    )


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists for one step of ``num_microbatches`` over ``num_stages``.

    Construction does not check the schedule (so that broken ones can be built, printed
    and rejected); call :func:`validate`. Generators only return validated schedules.
    """

    name: str
    num_stages: int
    num_microbatches: int
    routes: tuple[Route, ...]
    """One route per microbatch: the order in which the stages process it."""
    actions: tuple[tuple[Action, ...], ...]
    """One tuple of actions per stage, in execution order."""

    def for_stage(self, stage: int) -> tuple[Action, ...]:
        """The actions of ``stage``, in order.

        Raises:
            ValueError: if ``stage`` is outside ``range(num_stages)``.
        """
        if not 0 <= stage < len(self.actions):
            raise ValueError(f"stage {stage} outside 0..{len(self.actions) - 1}")
        return self.actions[stage]

    def has_backward(self) -> bool:
        """Whether the schedule runs backward at all (``False`` for :func:`forward_only`)."""
        return any(a.op is Op.BACKWARD for acts in self.actions for a in acts)

    def first_stage(self, microbatch: int) -> int:
        """The stage that runs ``microbatch`` first (it reads the inputs)."""
        return self.routes[microbatch][0]

    def last_stage(self, microbatch: int) -> int:
        """The stage that runs ``microbatch`` last (it computes the loss)."""
        return self.routes[microbatch][-1]

    def table(
        self,
        mark: tuple[int, int] | None = None,
        *,
        marks: Collection[tuple[int, int]] = (),
    ) -> str:
        """A stage-by-step table of the actions, for logs and error messages.

        Args:
            mark: ``(stage, action index)`` to highlight, shown as e.g. ``**F3**``.
            marks: further ``(stage, action index)`` pairs to highlight.
        """
        marked = set(marks)
        if mark is not None:
            marked.add(mark)
        width = max((len(acts) for acts in self.actions), default=0)
        rows = [["step", *map(str, range(width))]]
        for stage, acts in enumerate(self.actions):
            cells = [f"stage {stage}"]
            for index, action in enumerate(acts):
                text = str(action)
                cells.append(f"**{text}**" if (stage, index) in marked else text)
            cells.extend([""] * (width - len(acts)))
            rows.append(cells)
        widths = [max(len(row[c]) for row in rows) for c in range(width + 1)]
        lines = [f"{self.name}: {self.num_stages} stages x {self.num_microbatches} microbatches"]
        natural = tuple(range(self.num_stages))
        if any(route != natural for route in self.routes):
            lines.append(
                "routes: " + ", ".join(f"mb{m} {route}" for m, route in enumerate(self.routes))
            )
        lines.extend(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class ScheduleError(ValueError):
    """A schedule breaks [Note: schedule semantics] (in parallelism/schedule/validation.py).

    The message names the problem and contains the schedule's table with the offending
    action(s) marked; ``problem`` and ``marks`` (``(stage, action index)`` pairs) hold the
    parts separately. Picklable, so it survives being raised in a Ray worker.
    """

    def __init__(
        self,
        problem: str,
        schedule: Schedule | None = None,
        marks: Iterable[tuple[int, int]] = (),
    ) -> None:
        self.problem = problem
        self.marks = tuple(marks)
        message = problem if schedule is None else f"{problem}\n{schedule.table(marks=self.marks)}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[ScheduleError], tuple[str], dict[str, object]]:
        return ScheduleError, (str(self),), {"problem": self.problem, "marks": self.marks}


def neighbours(route: Route, stage: int) -> tuple[int | None, int | None]:
    """The stages before and after ``stage`` on ``route`` (None at either end)."""
    pos = route.index(stage)
    pred = route[pos - 1] if pos > 0 else None
    succ = route[pos + 1] if pos + 1 < len(route) else None
    return pred, succ
