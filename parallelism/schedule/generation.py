"""Generating schedules for any routes: `gpipe`, `one_f_one_b`, `forward_only`.

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
from collections import defaultdict
from collections.abc import Callable, Sequence

from parallelism.schedule.actions import (
    Action,
    Op,
    Route,
    Schedule,
    _check_sizes,
    _is_permutation,
    natural_routes,
    neighbours,
)
from parallelism.schedule.validation import validate


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
    nbrs = [[neighbours(route, s) for route in routes] for s in range(S)]
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
            pred, succ = neighbours(routes[action.microbatch], s)
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
            pred, succ = neighbours(routes[m], s)
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
