"""Microbatch schedules as data: what every pipeline stage does, in order, during one step.

A pipeline of ``S`` stages runs ``M`` microbatches per step. Microbatch ``m`` visits the
stages in the order of its *route* (normally ``0, 1, ..., S-1``; CheckFree+ swaps the first
two and the last two stages on odd microbatches). A :class:`Schedule` lists, for each stage,
the :class:`Action` s it performs -- receive, forward, send, backward -- and is checked by
:func:`validate` (counts, order, peers, FIFO channel matching, deadlock freedom) and timed by
:func:`dry_run` before any process runs it. :func:`gpipe`, :func:`one_f_one_b` and
:func:`forward_only` generate schedules for any routes.

[Note: schedule semantics]
A schedule is valid when all of the following hold; :func:`validate` checks them in this
order and names the first one that fails.

* Shape: ``len(routes) == M`` and every route is a permutation of ``range(S)``; there is
  one action tuple per stage; every microbatch index is in ``range(M)`` and every peer in
  ``range(S)``.
* Counts: for every stage ``s`` and microbatch ``m`` there is exactly one ``F``. Backward
  is all-or-none: if any stage has a ``B``, every ``(s, m)`` has exactly one ``B``
  (:meth:`Schedule.has_backward`); otherwise there is no ``B``, ``RB`` or ``SB`` at all.
  With ``pred``/``succ`` the stages before/after ``s`` on route ``m``: ``RF`` (from
  ``pred``) exists iff ``s`` is not the route's first stage, ``SF`` (to ``succ``) iff it is
  not the last, ``RB`` (from ``succ``) iff backward and not last, ``SB`` (to ``pred``) iff
  backward and not first. Each exists at most once.
* Peers: the peer of every communication action is exactly the route neighbour above.
* Order within a stage: ``RF < F < SF``, ``RB < B < SB`` and ``F < B`` (positions in the
  stage's action tuple). Receives need not sit right before their use.
* Communication: a send never blocks (it is buffered); a receive blocks until the matching
  send has been issued. Channels are FIFO per ordered pair ``(src, dst)``: the k-th receive
  that ``dst`` posts from ``src`` matches the k-th send that ``src`` issues to ``dst``, and
  must name the same kind (``F`` for RF/SF, ``B`` for RB/SB) and microbatch. NCCL matches
  point-to-point operations by issue order with no tags, so a schedule that relies on tags
  (which Gloo has) to pair messages would silently swap tensors there.
* Progress: running every stage as far as it can under the rule above finishes every
  stage. If stages remain blocked on receives whose sends are never issued, that is a
  deadlock, and the blocked actions are reported.

[Note: schedule generation]
Generators do not hard-wire microbatch indices. A greedy list-scheduling simulation over
the routes, in unit ticks, gives each stage its order of compute ops (``F``/``B``): at each
tick each stage runs at most one op whose input is ready (it was produced on an earlier
tick), chosen by the schedule's policy. Communication is then derived from that order:
sends right after the compute op that produces them, and receives right before the compute
op that consumes them -- except that a stage posts receives on a channel in the sender's
send order, so a receive may be posted early, just before the consumer of a later message
on the same channel. That is what keeps FIFO matching for mixed routes (one channel can
carry activations of one route and gradients of another). It cannot deadlock: every
message posted early was sent, in the tick simulation, before the message that was needed,
so the simulation's timeline is an execution of the schedule.

Policies. GPipe runs forwards in order of readiness (microbatch order for natural routes),
then, once all its forwards are done, backwards in order of readiness with ties going to the
most recent forward (reverse order for natural routes). ``forward_only`` is GPipe without
the backwards. 1F1B runs forwards strictly in microbatch order, at most ``S - s`` in flight
on stage ``s``, and a ready backward always goes first. The greedy never stalls, for any
routes: let ``m0`` be the oldest microbatch with an op left. Every older microbatch is done
everywhere, so a stage whose forward of ``m0`` is pending has nothing in flight and that
forward is allowed; the first pending forward along ``m0``'s route is therefore runnable,
and once all are done so is the first pending backward (backwards are never bounded).
"""

from __future__ import annotations

import enum
import math
import re
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "DryRun",
    "Op",
    "Route",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "dry_run",
    "forward_only",
    "gpipe",
    "natural_routes",
    "one_f_one_b",
    "swapped_routes",
    "theoretical_bubble",
    "validate",
]


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
    """A schedule breaks [Note: schedule semantics].

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


# ---------------------------------------------------------------------------------------
# Validation and simulation


def _neighbours(route: Route, stage: int) -> tuple[int | None, int | None]:
    pos = route.index(stage)
    pred = route[pos - 1] if pos > 0 else None
    succ = route[pos + 1] if pos + 1 < len(route) else None
    return pred, succ


def _check_shape(schedule: Schedule) -> None:
    S, M = schedule.num_stages, schedule.num_microbatches
    for name, value in (("num_stages", S), ("num_microbatches", M)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}", schedule)
    if len(schedule.routes) != M:
        raise ScheduleError(
            f"{len(schedule.routes)} routes for {M} microbatches: need one route per microbatch",
            schedule,
        )
    for m, route in enumerate(schedule.routes):
        if not _is_permutation(route, S):
            raise ScheduleError(
                f"route of microbatch {m} is {route!r}, not a permutation of range({S})", schedule
            )
    if len(schedule.actions) != S:
        raise ScheduleError(
            f"{len(schedule.actions)} action lists for {S} stages: need one per stage", schedule
        )
    for stage, acts in enumerate(schedule.actions):
        for index, action in enumerate(acts):
            if not isinstance(action, Action):
                raise ScheduleError(
                    f"stage {stage} action {index} is {action!r}, not an Action",
                    schedule,
                    [(stage, index)],
                )
            if action.microbatch >= M:
                raise ScheduleError(
                    f"stage {stage} action {index} ({action}) names microbatch "
                    f"{action.microbatch}, outside 0..{M - 1}",
                    schedule,
                    [(stage, index)],
                )
            if action.peer is not None and action.peer >= S:
                raise ScheduleError(
                    f"stage {stage} action {index} ({action}) names peer stage {action.peer}, "
                    f"outside 0..{S - 1}",
                    schedule,
                    [(stage, index)],
                )


_OP_NAMES = {
    Op.RECV_F: "receive of the activation (RF)",
    Op.FORWARD: "forward (F)",
    Op.SEND_F: "send of the activation (SF)",
    Op.RECV_B: "receive of the output gradient (RB)",
    Op.BACKWARD: "backward (B)",
    Op.SEND_B: "send of the input gradient (SB)",
}

# (earlier, later): the first must come before the second on a stage.
_ORDER = (
    (Op.RECV_F, Op.FORWARD),
    (Op.FORWARD, Op.SEND_F),
    (Op.FORWARD, Op.BACKWARD),
    (Op.RECV_B, Op.BACKWARD),
    (Op.BACKWARD, Op.SEND_B),
)


def _check_stage(schedule: Schedule, stage: int, backward: bool) -> None:
    where: dict[tuple[Op, int], list[int]] = defaultdict(list)
    for index, action in enumerate(schedule.actions[stage]):
        where[action.op, action.microbatch].append(index)
    for m, route in enumerate(schedule.routes):
        pred, succ = _neighbours(route, stage)
        expected = {
            Op.RECV_F: pred,
            Op.FORWARD: stage,
            Op.SEND_F: succ,
            Op.RECV_B: succ if backward else None,
            Op.BACKWARD: stage if backward else None,
            Op.SEND_B: pred if backward else None,
        }
        for op, peer in expected.items():
            found = where.get((op, m), [])
            if peer is None and found:
                why = {
                    Op.RECV_F: f"it is the first stage of route {route}",
                    Op.SEND_F: f"it is the last stage of route {route}",
                    Op.RECV_B: (
                        f"it is the last stage of route {route}"
                        if backward
                        else "the schedule has no backward"
                    ),
                    Op.SEND_B: (
                        f"it is the first stage of route {route}"
                        if backward
                        else "the schedule has no backward"
                    ),
                    Op.FORWARD: "",
                    Op.BACKWARD: "the schedule has no backward",
                }[op]
                raise ScheduleError(
                    f"stage {stage} must not have a {_OP_NAMES[op]} of microbatch {m}: {why}",
                    schedule,
                    [(stage, found[0])],
                )
            if peer is None:
                continue
            if not found:
                # Mark what the stage does have for this microbatch.
                anchor = sorted(i for o in Op for i in where.get((o, m), []))
                hint = (
                    " (a schedule with any backward needs one B per stage and microbatch)"
                    if op is Op.BACKWARD
                    else ""
                )
                raise ScheduleError(
                    f"stage {stage} has no {_OP_NAMES[op]} of microbatch {m} (route {route}){hint}",
                    schedule,
                    [(stage, i) for i in anchor],
                )
            if len(found) > 1:
                raise ScheduleError(
                    f"stage {stage} has {len(found)} copies of the {_OP_NAMES[op]} of "
                    f"microbatch {m}, expected exactly one",
                    schedule,
                    [(stage, i) for i in found],
                )
            action = schedule.actions[stage][found[0]]
            if not op.is_compute and action.peer != peer:
                role = "predecessor" if op in (Op.RECV_F, Op.SEND_B) else "successor"
                raise ScheduleError(
                    f"stage {stage} action {found[0]} ({action}) has peer {action.peer}, but "
                    f"the route {role} of stage {stage} for microbatch {m} is stage {peer} "
                    f"(route {route})",
                    schedule,
                    [(stage, found[0])],
                )
        for first, then in _ORDER:
            a, b = where.get((first, m)), where.get((then, m))
            if a and b and a[0] > b[0]:
                late = a[0] if first.is_recv else b[0]
                raise ScheduleError(
                    f"stage {stage} runs {schedule.actions[stage][b[0]]} (action {b[0]}) before "
                    f"{schedule.actions[stage][a[0]]} (action {a[0]}): the "
                    f"{_OP_NAMES[first]} of microbatch {m} must come before its "
                    f"{_OP_NAMES[then]}",
                    schedule,
                    [(stage, late)],
                )


@dataclass(frozen=True)
class _Sent:
    kind: Op
    microbatch: int
    time: float
    stage: int
    index: int


def _execute(
    schedule: Schedule, forward_cost: float, backward_cost: float
) -> tuple[list[float], list[float]]:
    """Run all stages under the communication model; return (finish times, busy times).

    Assumes ``_check_shape`` passed (peers and microbatches in range).

    Raises:
        ScheduleError: on a FIFO mismatch, a deadlock, or a send that is never received.
    """
    S = schedule.num_stages
    channels: dict[tuple[int, int], deque[_Sent]] = defaultdict(deque)
    pc = [0] * S
    clock = [0.0] * S
    busy = [0.0] * S
    while True:
        progressed = False
        for stage, acts in enumerate(schedule.actions):
            while pc[stage] < len(acts):
                index = pc[stage]
                action = acts[index]
                if action.op.is_compute:
                    cost = forward_cost if action.op is Op.FORWARD else backward_cost
                    clock[stage] += cost
                    busy[stage] += cost
                elif action.op.is_send:
                    assert action.peer is not None
                    channels[stage, action.peer].append(
                        _Sent(action.op.kind, action.microbatch, clock[stage], stage, index)
                    )
                else:
                    assert action.peer is not None
                    queue = channels[action.peer, stage]
                    if not queue:
                        break
                    sent = queue[0]
                    if (sent.kind, sent.microbatch) != (action.op.kind, action.microbatch):
                        send = schedule.actions[sent.stage][sent.index]
                        raise ScheduleError(
                            f"FIFO mismatch on channel {sent.stage}->{stage}: stage {stage}'s "
                            f"receive {action} (action {index}) is matched, in issue order, "
                            f"with stage {sent.stage}'s send {send} (action {sent.index}). "
                            "NCCL pairs point-to-point ops by issue order, so receives on a "
                            "channel must be posted in the order the sender issues its sends",
                            schedule,
                            [(stage, index), (sent.stage, sent.index)],
                        )
                    queue.popleft()
                    clock[stage] = max(clock[stage], sent.time)
                pc[stage] += 1
                progressed = True
        if all(pc[s] == len(acts) for s, acts in enumerate(schedule.actions)):
            break
        if not progressed:
            stuck = [(s, pc[s]) for s, acts in enumerate(schedule.actions) if pc[s] < len(acts)]
            details = []
            for s, i in stuck:
                action = schedule.actions[s][i]
                peer = action.peer
                assert peer is not None
                state = (
                    f"blocked at {schedule.actions[peer][pc[peer]]} (action {pc[peer]})"
                    if pc[peer] < len(schedule.actions[peer])
                    else "finished without sending it"
                )
                details.append(
                    f"stage {s} waits at {action} (action {i}) for stage {peer}, {state}"
                )
            raise ScheduleError(
                "deadlock: every unfinished stage is blocked on a receive whose send is never "
                "issued: " + "; ".join(details),
                schedule,
                stuck,
            )
    for (src, dst), queue in channels.items():
        if queue:
            sent = queue[0]
            raise ScheduleError(
                f"stage {src}'s send {schedule.actions[src][sent.index]} (action {sent.index}) "
                f"is never received by stage {dst}",
                schedule,
                [(src, sent.index)],
            )
    return clock, busy


def validate(schedule: Schedule) -> None:
    """Check ``schedule`` against [Note: schedule semantics].

    Raises:
        ScheduleError: naming the first broken rule, with the schedule's table and the
            offending action(s) marked: a malformed route or action, a missing, extra or
            misplaced action, a wrong peer, a FIFO mismatch, or a deadlock.
    """
    _check_shape(schedule)
    backward = schedule.has_backward()
    for stage in range(schedule.num_stages):
        _check_stage(schedule, stage, backward)
    _execute(schedule, 1.0, 2.0)


# ---------------------------------------------------------------------------------------
# Generation: see [Note: schedule generation]


def _normalize_routes(
    num_stages: int, num_microbatches: int, routes: Sequence[Sequence[int]] | None
) -> tuple[Route, ...]:
    _check_sizes(num_stages, num_microbatches)
    if routes is None:
        return natural_routes(num_stages, num_microbatches)
    result = tuple(tuple(route) for route in routes)
    if len(result) != num_microbatches:
        raise ValueError(
            f"got {len(result)} routes for {num_microbatches} microbatches; pass one per microbatch"
        )
    for m, route in enumerate(result):
        if not _is_permutation(route, num_stages):
            raise ValueError(
                f"route of microbatch {m} is {route}, not a permutation of range({num_stages})"
            )
    return result


class _Policy(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    FORWARD_ONLY = "forward_only"


def _compute_orders(
    num_stages: int, routes: tuple[Route, ...], policy: _Policy
) -> list[list[Action]]:
    """Greedy unit-tick list scheduling of the compute ops over ``routes``."""
    S, M = num_stages, len(routes)
    nbrs = [[_neighbours(route, s) for route in routes] for s in range(S)]
    f_done: list[list[int | None]] = [[None] * M for _ in range(S)]
    b_done: list[list[int | None]] = [[None] * M for _ in range(S)]
    orders: list[list[Action]] = [[] for _ in range(S)]
    backward = policy is not _Policy.FORWARD_ONLY
    total = S * M * (2 if backward else 1)
    done = 0
    tick = 0

    def ready_forwards(s: int) -> list[tuple[int, int]]:
        """(ready tick, microbatch) of the forwards stage ``s`` could run now."""
        out = []
        for m in range(M):
            if f_done[s][m] is not None:
                continue
            pred = nbrs[s][m][0]
            if pred is None:
                out.append((0, m))
            else:
                t = f_done[pred][m]
                if t is not None and t < tick:
                    out.append((t + 1, m))
        return out

    def ready_backwards(s: int) -> list[tuple[int, int, int]]:
        """(ready tick, forward tick, microbatch) of the backwards stage ``s`` could run now."""
        out = []
        for m in range(M):
            tf = f_done[s][m]
            if b_done[s][m] is not None or tf is None or tf >= tick:
                continue
            succ = nbrs[s][m][1]
            if succ is None:
                out.append((tf + 1, tf, m))
            else:
                tb = b_done[succ][m]
                if tb is not None and tb < tick:
                    out.append((max(tf, tb) + 1, tf, m))
        return out

    while done < total:
        picks: dict[int, Action] = {}
        for s in range(S):
            forwards_left = any(t is None for t in f_done[s])
            if policy is _Policy.FORWARD_ONLY or (policy is _Policy.GPIPE and forwards_left):
                fwd = ready_forwards(s)
                if fwd:
                    picks[s] = Action(Op.FORWARD, min(fwd)[1])
            elif policy is _Policy.GPIPE:
                # All forwards are done, so every backward is gated by the last of them:
                # ties go to the most recent forward, i.e. reverse order for natural routes.
                gate = max(t for t in f_done[s] if t is not None) + 1
                bwd = ready_backwards(s)
                if bwd:
                    _, _, m = min((max(r, gate), -tf, m) for r, tf, m in bwd)
                    picks[s] = Action(Op.BACKWARD, m)
            else:
                bwd = ready_backwards(s)
                in_flight = sum(
                    1 for m in range(M) if f_done[s][m] is not None and b_done[s][m] is None
                )
                if bwd:
                    picks[s] = Action(Op.BACKWARD, min(bwd)[2])
                elif in_flight < num_stages - s:
                    # Forwards strictly in microbatch order: a stage must not fill its
                    # in-flight budget with microbatches whose route starts there while an
                    # older one waits for it (that stalls swapped routes). See the proof of
                    # progress in [Note: schedule generation].
                    nxt = next((m for m in range(M) if f_done[s][m] is None), None)
                    if nxt is not None and any(m == nxt for _, m in ready_forwards(s)):
                        picks[s] = Action(Op.FORWARD, nxt)
        assert picks, f"{policy.value} list scheduling stalled at tick {tick}"
        for s, action in picks.items():
            table = f_done if action.op is Op.FORWARD else b_done
            table[s][action.microbatch] = tick
            orders[s].append(action)
            done += 1
        tick += 1
    return orders


def _build(name: str, num_stages: int, routes: tuple[Route, ...], policy: _Policy) -> Schedule:
    orders = _compute_orders(num_stages, routes, policy)
    # The sequence of messages on each channel, in the sender's issue order.
    channel: dict[tuple[int, int], list[tuple[Op, int]]] = defaultdict(list)
    for s, order in enumerate(orders):
        for action in order:
            pred, succ = _neighbours(routes[action.microbatch], s)
            dst = succ if action.op is Op.FORWARD else pred
            if dst is not None:
                channel[s, dst].append((action.op, action.microbatch))
    position = {
        (src, dst, msg): k for (src, dst), msgs in channel.items() for k, msg in enumerate(msgs)
    }
    per_stage: list[tuple[Action, ...]] = []
    for s, order in enumerate(orders):
        posted: dict[int, int] = defaultdict(int)  # src -> number of receives posted
        acts: list[Action] = []
        for action in order:
            m = action.microbatch
            pred, succ = _neighbours(routes[m], s)
            src, dst = (pred, succ) if action.op is Op.FORWARD else (succ, pred)
            if src is not None:
                msgs = channel[src, s]
                last = position[src, s, (action.op, m)]
                while posted[src] <= last:
                    kind, mb = msgs[posted[src]]
                    recv = Op.RECV_F if kind is Op.FORWARD else Op.RECV_B
                    acts.append(Action(recv, mb, src))
                    posted[src] += 1
            acts.append(action)
            if dst is not None:
                send = Op.SEND_F if action.op is Op.FORWARD else Op.SEND_B
                acts.append(Action(send, m, dst))
        per_stage.append(tuple(acts))
    schedule = Schedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=len(routes),
        routes=routes,
        actions=tuple(per_stage),
    )
    validate(schedule)
    return schedule


def gpipe(
    num_stages: int, num_microbatches: int, routes: Sequence[Sequence[int]] | None = None
) -> Schedule:
    """GPipe: each stage runs all its forwards, then all its backwards.

    Forwards run in order of readiness (microbatch order for natural routes); backwards
    start when the stage's forwards are all done, in order of readiness, ties going to the
    most recent forward (reverse microbatch order for natural routes).

    Raises:
        ValueError: if a size is not a positive integer, or ``routes`` is not one
            permutation of ``range(num_stages)`` per microbatch.
    """
    resolved = _normalize_routes(num_stages, num_microbatches, routes)
    return _build("gpipe", num_stages, resolved, _Policy.GPIPE)


def one_f_one_b(
    num_stages: int, num_microbatches: int, routes: Sequence[Sequence[int]] | None = None
) -> Schedule:
    """1F1B: stage ``s`` keeps at most ``S - s`` microbatches in flight.

    Forwards run in microbatch order. After a warmup of forwards, each stage alternates one
    forward and one backward, preferring a backward whenever one is ready; this bounds
    activation memory on stage ``s`` to ``S - s`` microbatches, for any routes. With
    natural routes this is the textbook 1F1B (warmup of ``S - s - 1`` forwards).

    Raises:
        ValueError: if a size is not a positive integer, or ``routes`` is not one
            permutation of ``range(num_stages)`` per microbatch.
    """
    resolved = _normalize_routes(num_stages, num_microbatches, routes)
    return _build("1f1b", num_stages, resolved, _Policy.ONE_F_ONE_B)


def forward_only(
    num_stages: int, num_microbatches: int, routes: Sequence[Sequence[int]] | None = None
) -> Schedule:
    """Evaluation: forwards (with their receives and sends) only, in order of readiness.

    Raises:
        ValueError: if a size is not a positive integer, or ``routes`` is not one
            permutation of ``range(num_stages)`` per microbatch.
    """
    resolved = _normalize_routes(num_stages, num_microbatches, routes)
    return _build("forward_only", num_stages, resolved, _Policy.FORWARD_ONLY)


SCHEDULES: dict[str, Callable[..., Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    routes: Sequence[Sequence[int]] | None = None,
) -> Schedule:
    """The training schedule called ``name`` (a key of :data:`SCHEDULES`).

    Raises:
        ValueError: if ``name`` is unknown (the message lists the known names), or the
            sizes or routes are invalid.
    """
    try:
        factory = SCHEDULES[name]
    except KeyError:
        known = ", ".join(sorted(SCHEDULES))
        raise ValueError(f"unknown schedule {name!r}; known schedules: {known}") from None
    return factory(num_stages, num_microbatches, routes)


# ---------------------------------------------------------------------------------------
# Dry run


@dataclass(frozen=True)
class DryRun:
    """Timing of a schedule under fixed compute costs and free communication."""

    makespan: float
    """Time at which the last stage finishes."""
    busy: tuple[float, ...]
    """Compute time of each stage."""
    bubble_fraction: float
    """Idle share of the pipeline: ``1 - sum(busy) / (S * makespan)``."""


def dry_run(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0) -> DryRun:
    """Simulate ``schedule`` with each ``F`` costing ``forward_cost`` and ``B`` ``backward_cost``.

    Each stage runs its actions sequentially; a receive completes when the matching send
    was issued (communication is free), sends never block.

    Raises:
        ValueError: if ``forward_cost`` is not positive or ``backward_cost`` is negative.
        ScheduleError: if the schedule is invalid (see :func:`validate`).
    """
    if not (math.isfinite(forward_cost) and forward_cost > 0):
        raise ValueError(f"forward_cost must be a positive number, got {forward_cost!r}")
    if not (math.isfinite(backward_cost) and backward_cost >= 0):
        raise ValueError(f"backward_cost must be a non-negative number, got {backward_cost!r}")
    validate(schedule)
    finish, busy = _execute(schedule, forward_cost, backward_cost)
    makespan = max(finish)
    bubble = 1.0 - sum(busy) / (schedule.num_stages * makespan)
    return DryRun(makespan=makespan, busy=tuple(busy), bubble_fraction=bubble)


def theoretical_bubble(num_stages: int, num_microbatches: int) -> float:
    """The textbook bubble fraction ``(S - 1) / (M + S - 1)`` of GPipe and 1F1B.

    Raises:
        ValueError: if either argument is not a positive integer.
    """
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
