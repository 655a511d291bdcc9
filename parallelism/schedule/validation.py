"""Checking a schedule before any process runs it, and timing it: `validate`, `dry_run`.

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
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

from parallelism.schedule.actions import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    _check_sizes,
    _is_permutation,
    neighbours,
)


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
        pred, succ = neighbours(route, stage)
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
