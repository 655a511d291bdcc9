"""Tests for parallelism.schedule: generated schedules validate, broken ones do not.

The corruption properties compare :func:`validate` with ``_reference_ok``, an independent
oracle that runs the schedule with real payloads (each forward composes its input with its
stage, each backward does the same on the way back) over FIFO channels and checks that
every compute op sees exactly the value the route says it should.
"""

from __future__ import annotations

import itertools
import math
import pickle
from collections import defaultdict, deque
from collections.abc import Callable

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from parallelism.schedule import (
    SCHEDULES,
    Action,
    DryRun,
    Op,
    Route,
    Schedule,
    ScheduleError,
    build_schedule,
    dry_run,
    forward_only,
    gpipe,
    natural_routes,
    one_f_one_b,
    swapped_routes,
    theoretical_bubble,
    validate,
)

Generator = Callable[..., Schedule]
GENERATORS: tuple[Generator, ...] = (gpipe, one_f_one_b, forward_only)
TRAINING: tuple[Generator, ...] = (gpipe, one_f_one_b)


# ---------------------------------------------------------------------------------------
# Helpers


def _schedule(routes: list[Route], rows: list[str], name: str = "hand") -> Schedule:
    """A schedule from one whitespace-separated row of compact actions per stage."""
    return Schedule(
        name=name,
        num_stages=len(rows),
        num_microbatches=len(routes),
        routes=tuple(routes),
        actions=tuple(tuple(Action.from_str(t) for t in row.split()) for row in rows),
    )


def _replace(schedule: Schedule, stage: int, actions: list[Action]) -> Schedule:
    rows = list(schedule.actions)
    rows[stage] = tuple(actions)
    return Schedule(
        name=schedule.name,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        routes=schedule.routes,
        actions=tuple(rows),
    )


def _compute(schedule: Schedule, stage: int) -> list[str]:
    return [str(a) for a in schedule.for_stage(stage) if a.op.is_compute]


def _reference_ok(schedule: Schedule) -> bool:
    """Independent oracle: does ``schedule`` compute the right thing without hanging?"""
    S, M, routes = schedule.num_stages, schedule.num_microbatches, schedule.routes
    if len(routes) != M or any(sorted(r) != list(range(S)) for r in routes):
        return False
    if len(schedule.actions) != S:
        return False
    backward = any(a.op is Op.BACKWARD for row in schedule.actions for a in row)
    for s, row in enumerate(schedule.actions):
        counts: dict[tuple[Op, int], int] = defaultdict(int)
        for a in row:
            if a.microbatch >= M or (a.peer is not None and a.peer >= S):
                return False
            counts[a.op, a.microbatch] += 1
        for m, route in enumerate(routes):
            first, last = route[0] == s, route[-1] == s
            want = {
                Op.RECV_F: not first,
                Op.FORWARD: True,
                Op.SEND_F: not last,
                Op.RECV_B: backward and not last,
                Op.BACKWARD: backward,
                Op.SEND_B: backward and not first,
            }
            if any(counts[op, m] != int(need) for op, need in want.items()):
                return False

    def expected_activation(m: int, upto: int) -> object:
        value: object = ("x", m)
        for stage in routes[m][:upto]:
            value = ("f", stage, value)
        return value

    def expected_grad(m: int, pos: int) -> object:
        value: object = ("loss", expected_activation(m, S))
        for stage in reversed(routes[m][pos + 1 :]):
            value = ("g", stage, value)
        return value

    channels: dict[tuple[int, int], deque[object]] = defaultdict(deque)
    got: dict[tuple[int, Op, int], object] = {}
    out: dict[tuple[int, Op, int], object] = {}
    pc = [0] * S
    while True:
        moved = False
        for s in range(S):
            row = schedule.actions[s]
            while pc[s] < len(row):
                a = row[pc[s]]
                m = a.microbatch
                pos = routes[m].index(s)
                if a.op in (Op.RECV_F, Op.RECV_B):
                    assert a.peer is not None
                    queue = channels[a.peer, s]
                    if not queue:
                        break
                    got[s, a.op, m] = queue.popleft()
                elif a.op in (Op.SEND_F, Op.SEND_B):
                    assert a.peer is not None
                    kind = Op.FORWARD if a.op is Op.SEND_F else Op.BACKWARD
                    if (s, kind, m) not in out:
                        return False
                    channels[s, a.peer].append(out[s, kind, m])
                elif a.op is Op.FORWARD:
                    value = ("x", m) if pos == 0 else got.get((s, Op.RECV_F, m))
                    if value != expected_activation(m, pos):
                        return False
                    out[s, Op.FORWARD, m] = ("f", s, value)
                else:
                    if (s, Op.FORWARD, m) not in out:
                        return False
                    if pos == S - 1:
                        value = ("loss", out[s, Op.FORWARD, m])
                    else:
                        value = got.get((s, Op.RECV_B, m))
                    if value != expected_grad(m, pos):
                        return False
                    out[s, Op.BACKWARD, m] = ("g", s, value)
                pc[s] += 1
                moved = True
        if all(pc[s] == len(schedule.actions[s]) for s in range(S)):
            return not any(channels.values())
        if not moved:
            return False


def _in_flight_max(schedule: Schedule, stage: int) -> int:
    live = peak = 0
    for a in schedule.for_stage(stage):
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.BACKWARD:
            live -= 1
    return peak


# ---------------------------------------------------------------------------------------
# Strategies

sizes = st.tuples(st.integers(1, 8), st.integers(1, 16))


@st.composite
def random_routes(draw: st.DrawFn, max_stages: int = 6, max_microbatches: int = 8) -> list[Route]:
    S = draw(st.integers(1, max_stages))
    M = draw(st.integers(1, max_microbatches))
    return [tuple(draw(st.permutations(range(S)))) for _ in range(M)]


@st.composite
def valid_schedules(draw: st.DrawFn) -> Schedule:
    generator = draw(st.sampled_from(GENERATORS))
    S = draw(st.integers(1, 5))
    M = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(["natural", "swapped", "random"]))
    if kind == "swapped" and S >= 4:
        routes: list[Route] | None = list(swapped_routes(S, M))
    elif kind == "random":
        routes = [tuple(draw(st.permutations(range(S)))) for _ in range(M)]
    else:
        routes = None
    return generator(S, M, routes)


# ---------------------------------------------------------------------------------------
# Routes, actions, registry


def test_routes() -> None:
    assert natural_routes(3, 2) == ((0, 1, 2), (0, 1, 2))
    assert swapped_routes(4, 3) == ((0, 1, 2, 3), (1, 0, 3, 2), (0, 1, 2, 3))
    assert swapped_routes(6, 2)[1] == (1, 0, 2, 3, 5, 4)
    with pytest.raises(ValueError, match="num_stages >= 4"):
        swapped_routes(3, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        natural_routes(2, 0)


@pytest.mark.parametrize(
    ("action", "text"),
    [
        (Action(Op.FORWARD, 3), "F3"),
        (Action(Op.BACKWARD, 3), "B3"),
        (Action(Op.RECV_F, 3, 1), "RF3<1"),
        (Action(Op.SEND_F, 3, 2), "SF3>2"),
        (Action(Op.RECV_B, 3, 2), "RB3<2"),
        (Action(Op.SEND_B, 3, 0), "SB3>0"),
        (Action(Op.SEND_B, 12, 10), "SB12>10"),
    ],
)
def test_action_str_round_trip(action: Action, text: str) -> None:
    assert str(action) == text
    assert Action.from_str(text) == action


@pytest.mark.parametrize("text", ["F", "X3", "RF3", "RF3>1", "SF3<1", "F3<1", "B-1"])
def test_action_from_str_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        Action.from_str(text)


def test_action_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="no peer"):
        Action(Op.FORWARD, 0, 1)
    with pytest.raises(ValueError, match="needs a peer"):
        Action(Op.RECV_F, 0)
    with pytest.raises(ValueError, match=">= 0"):
        Action(Op.BACKWARD, -1)
    assert Action("F", 2) == Action(Op.FORWARD, 2)  # type: ignore[arg-type]


def test_build_schedule() -> None:
    assert set(SCHEDULES) == {"gpipe", "1f1b"}
    assert build_schedule("1f1b", 3, 4) == one_f_one_b(3, 4)
    assert build_schedule("gpipe", 3, 4).name == "gpipe"
    with pytest.raises(ValueError, match=r"'zigzag'.*1f1b, gpipe"):
        build_schedule("zigzag", 3, 4)


@pytest.mark.parametrize("generator", GENERATORS)
def test_generators_reject_bad_arguments(generator: Generator) -> None:
    with pytest.raises(ValueError, match="num_stages"):
        generator(0, 2)
    with pytest.raises(ValueError, match="2 routes for 3 microbatches"):
        generator(2, 3, [(0, 1), (1, 0)])
    with pytest.raises(ValueError, match="not a permutation"):
        generator(2, 1, [(0, 0)])


def test_schedule_accessors() -> None:
    schedule = gpipe(4, 2, swapped_routes(4, 2))
    assert schedule.has_backward()
    assert not forward_only(4, 2).has_backward()
    assert (schedule.first_stage(0), schedule.last_stage(0)) == (0, 3)
    assert (schedule.first_stage(1), schedule.last_stage(1)) == (1, 2)
    assert schedule.for_stage(2) == schedule.actions[2]
    with pytest.raises(ValueError, match="stage 4"):
        schedule.for_stage(4)


def test_table_marks_action() -> None:
    schedule = gpipe(2, 2)
    table = schedule.table(mark=(1, 1))
    assert "**F0**" in table
    assert table.count("**") == 2
    assert "stage 0" in table and "stage 1" in table
    assert "routes:" not in table
    assert "routes: mb0 (0, 1, 2, 3), mb1 (1, 0, 3, 2)" in gpipe(4, 2, swapped_routes(4, 2)).table()


# ---------------------------------------------------------------------------------------
# Generated schedules


def test_gpipe_order_natural() -> None:
    schedule = gpipe(3, 4)
    for s in range(3):
        assert _compute(schedule, s) == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]
    # Receives sit right before their use and sends right after for natural routes.
    assert [str(a) for a in schedule.for_stage(1)[:6]] == [
        "RF0<0",
        "F0",
        "SF0>2",
        "RF1<0",
        "F1",
        "SF1>2",
    ]


@pytest.mark.parametrize(("S", "M"), list(itertools.product(range(1, 7), range(1, 10))))
def test_1f1b_is_textbook_and_bounded(S: int, M: int) -> None:
    schedule = one_f_one_b(S, M)
    for s in range(S):
        warmup = min(S - s - 1, M)
        want = [f"F{m}" for m in range(warmup)]
        for i in range(M - warmup):
            want += [f"F{warmup + i}", f"B{i}"]
        want += [f"B{m}" for m in range(M - warmup, M)]
        assert _compute(schedule, s) == want
        assert _in_flight_max(schedule, s) == min(S - s, M)


@given(st.integers(4, 8), st.integers(1, 16))
@settings(max_examples=40, deadline=None)
def test_1f1b_bound_holds_for_swapped_routes(S: int, M: int) -> None:
    schedule = one_f_one_b(S, M, swapped_routes(S, M))
    for s in range(S):
        assert _in_flight_max(schedule, s) <= S - s


@given(sizes, st.sampled_from(GENERATORS), st.booleans())
@settings(max_examples=120, deadline=None)
def test_generated_schedules_validate(
    size: tuple[int, int], generator: Generator, swapped: bool
) -> None:
    S, M = size
    routes = swapped_routes(S, M) if swapped and S >= 4 else natural_routes(S, M)
    schedule = generator(S, M, routes)
    validate(schedule)
    assert schedule.routes == routes
    assert schedule.has_backward() == (generator is not forward_only)
    assert len(schedule.actions) == S
    if S <= 5 and M <= 8:
        assert _reference_ok(schedule)


@given(random_routes(), st.sampled_from(GENERATORS))
@settings(max_examples=120, deadline=None)
def test_random_routes_validate(routes: list[Route], generator: Generator) -> None:
    S, M = len(routes[0]), len(routes)
    schedule = generator(S, M, routes)
    validate(schedule)
    assert _reference_ok(schedule)
    assert dry_run(schedule).makespan > 0


@given(random_routes(max_stages=8, max_microbatches=12))
@settings(max_examples=100, deadline=None)
def test_1f1b_bound_holds_for_any_routes(routes: list[Route]) -> None:
    S, M = len(routes[0]), len(routes)
    schedule = one_f_one_b(S, M, routes)
    for s in range(S):
        assert _in_flight_max(schedule, s) <= S - s
        forwards = [a for a in _compute(schedule, s) if a.startswith("F")]
        assert forwards == [f"F{m}" for m in range(M)]


# ---------------------------------------------------------------------------------------
# Dry run


@pytest.mark.parametrize(("S", "M"), list(itertools.product(range(1, 7), range(1, 10))))
@pytest.mark.parametrize("generator", TRAINING)
def test_dry_run_bubble_matches_theory(generator: Generator, S: int, M: int) -> None:
    result = dry_run(generator(S, M), forward_cost=1.0, backward_cost=2.0)
    assert result.makespan == pytest.approx((M + S - 1) * 3.0)
    assert result.busy == (3.0 * M,) * S
    assert result.bubble_fraction == pytest.approx(theoretical_bubble(S, M))


def test_dry_run_forward_only_and_costs() -> None:
    result = dry_run(forward_only(4, 6), forward_cost=0.5)
    assert result == DryRun(makespan=4.5, busy=(3.0,) * 4, bubble_fraction=1 - 12 / 18)
    assert theoretical_bubble(4, 6) == pytest.approx(3 / 9)
    with pytest.raises(ValueError, match="forward_cost"):
        dry_run(gpipe(2, 2), forward_cost=0)
    with pytest.raises(ValueError, match="backward_cost"):
        dry_run(gpipe(2, 2), backward_cost=math.nan)
    with pytest.raises(ValueError, match="num_microbatches"):
        theoretical_bubble(2, 0)


def test_dry_run_rejects_invalid() -> None:
    with pytest.raises(ScheduleError, match="deadlock"):
        dry_run(_deadlocked())


# ---------------------------------------------------------------------------------------
# Rejection: deterministic cases, one per kind of corruption

ROUTES_2x2: list[Route] = [(0, 1), (0, 1)]
GOOD_2x2 = [
    "F0 SF0>1 F1 SF1>1 RB1<1 B1 RB0<1 B0",
    "RF0<0 F0 RF1<0 F1 B1 SB1>0 B0 SB0>0",
]


def _deadlocked() -> Schedule:
    # Stage 0 waits for the gradient of microbatch 0 before sending microbatch 1's
    # activation, while stage 1 waits for that activation before running backward.
    return _schedule(
        ROUTES_2x2,
        [
            "F0 SF0>1 F1 RB0<1 SF1>1 B0 RB1<1 B1",
            "RF0<0 F0 RF1<0 F1 B0 SB0>0 B1 SB1>0",
        ],
    )


def test_hand_written_schedule_is_valid() -> None:
    good = _schedule(ROUTES_2x2, GOOD_2x2)
    validate(good)
    assert _reference_ok(good)


def test_deadlock_rejected() -> None:
    schedule = _deadlocked()
    assert not _reference_ok(schedule)
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(schedule)
    assert "**RB0<1**" in str(info.value)
    assert "**RF1<0**" in str(info.value)
    assert set(info.value.marks) == {(0, 3), (1, 2)}
    copy = pickle.loads(pickle.dumps(info.value))
    assert (str(copy), copy.problem, copy.marks) == (
        str(info.value),
        info.value.problem,
        info.value.marks,
    )


@pytest.mark.parametrize(
    ("rows", "routes", "message", "marked"),
    [
        pytest.param(  # dropped action
            ["F0 SF0>1 F1 SF1>1 RB1<1 B1 RB0<1 B0", "RF0<0 F0 RF1<0 F1 B1 SB1>0 B0"],
            ROUTES_2x2,
            "stage 1 has no send of the input gradient",
            "**B0**",
            id="drop",
        ),
        pytest.param(  # duplicated action
            ["F0 SF0>1 F1 SF1>1 RB1<1 B1 RB0<1 B0", "RF0<0 F0 F0 RF1<0 F1 B1 SB1>0 B0 SB0>0"],
            ROUTES_2x2,
            "stage 1 has 2 copies of the forward",
            "**F0**",
            id="duplicate",
        ),
        pytest.param(  # receive after its use
            ["F0 SF0>1 F1 SF1>1 RB1<1 B1 RB0<1 B0", "F0 RF0<0 RF1<0 F1 B1 SB1>0 B0 SB0>0"],
            ROUTES_2x2,
            "must come before",
            "**RF0<0**",
            id="recv-after-use",
        ),
        pytest.param(  # backward before forward
            ["F0 SF0>1 B1 F1 SF1>1 RB1<1 RB0<1 B0", GOOD_2x2[1]],
            ROUTES_2x2,
            r"runs B1 \(action 2\) before F1",
            "**B1**",
            id="backward-before-forward",
        ),
        pytest.param(  # send before the compute that produces it
            ["SF0>1 F0 F1 SF1>1 RB1<1 B1 RB0<1 B0", GOOD_2x2[1]],
            ROUTES_2x2,
            "must come before",
            "**SF0>1**",
            id="send-before-compute",
        ),
        pytest.param(  # wrong peer
            ["F0 SF0>2", "RF0<0 F0 SF0>2", "RF0<1 F0"],
            [(0, 1, 2)],
            "route successor of stage 0 for microbatch 0 is stage 1",
            "**SF0>2**",
            id="peer",
        ),
        pytest.param(  # receive on the first stage of the route
            ["RF0<1 F0 SF0>1", "RF0<0 F0"],
            [(0, 1)],
            "must not have a receive of the activation",
            "**RF0<1**",
            id="recv-on-first-stage",
        ),
        pytest.param(  # FIFO: stage 0 sends 0 then 1, stage 1 receives 1 then 0
            ["F0 SF0>1 F1 SF1>1 RB1<1 B1 RB0<1 B0", "RF1<0 RF0<0 F0 F1 B1 SB1>0 B0 SB0>0"],
            ROUTES_2x2,
            "FIFO mismatch on channel 0->1",
            "**RF1<0**",
            id="fifo",
        ),
        pytest.param(  # microbatch out of range
            ["F0 SF0>1 F2", "RF0<0 F0"],
            [(0, 1)],
            "microbatch 2, outside 0..0",
            "**F2**",
            id="microbatch-range",
        ),
        pytest.param(  # backward missing on one stage only
            ["F0 SF0>1 RB0<1 B0", "RF0<0 F0"],
            [(0, 1)],
            "stage 1 has no backward",
            "**F0**",
            id="partial-backward",
        ),
        pytest.param(  # bad route
            ["F0 SF0>1", "RF0<0 F0"],
            [(0, 0)],
            "not a permutation",
            "stage 0",
            id="route",
        ),
    ],
)
def test_corruption_rejected(
    rows: list[str], routes: list[Route], message: str, marked: str
) -> None:
    schedule = _schedule(routes, rows)
    assert not _reference_ok(schedule)
    with pytest.raises(ScheduleError, match=message) as info:
        validate(schedule)
    text = str(info.value)
    assert marked in text
    assert schedule.table().splitlines()[0] in text


def test_fifo_mismatch_on_mixed_channel() -> None:
    # Channel 0->1 carries microbatch 0's activation and microbatch 1's gradient (route
    # (1, 0)); stage 1 must receive them in the order stage 0 sends them.
    routes: list[Route] = [(0, 1), (1, 0)]
    good = one_f_one_b(2, 2, routes)
    validate(good)
    row = list(good.for_stage(1))
    receives = [i for i, a in enumerate(row) if a.op.is_recv and a.peer == 0]
    assert len(receives) == 2
    i, j = receives
    row[i], row[j] = row[j], row[i]
    bad = _replace(good, 1, row)
    assert not _reference_ok(bad)
    with pytest.raises(ScheduleError):
        validate(bad)


# ---------------------------------------------------------------------------------------
# Rejection: hypothesis corruptions, checked against the reference oracle

_DEPENDENT = {
    (Op.RECV_F, Op.FORWARD),
    (Op.FORWARD, Op.SEND_F),
    (Op.FORWARD, Op.BACKWARD),
    (Op.RECV_B, Op.BACKWARD),
    (Op.BACKWARD, Op.SEND_B),
}


def _corrupt(data: st.DataObject, schedule: Schedule, kind: str) -> Schedule | None:
    """Apply a corruption of ``kind``; None when ``schedule`` offers no place for it."""
    S = schedule.num_stages
    stage = data.draw(st.integers(0, S - 1), label="stage")
    row = list(schedule.for_stage(stage))
    if kind == "drop":
        del row[data.draw(st.integers(0, len(row) - 1), label="index")]
    elif kind == "duplicate":
        action = row[data.draw(st.integers(0, len(row) - 1), label="index")]
        row.insert(data.draw(st.integers(0, len(row)), label="at"), action)
    elif kind == "peer":
        comm = [i for i, a in enumerate(row) if not a.op.is_compute]
        if not comm:
            return None
        i = data.draw(st.sampled_from(comm), label="index")
        old = row[i]
        peer = data.draw(st.sampled_from([p for p in range(S) if p != old.peer]), label="peer")
        row[i] = Action(old.op, old.microbatch, peer)
    elif kind == "order":
        # Swap an action with one it depends on (or that depends on it).
        pairs = [
            (i, j)
            for i, j in itertools.combinations(range(len(row)), 2)
            if row[i].microbatch == row[j].microbatch and (row[i].op, row[j].op) in _DEPENDENT
        ]
        if not pairs:
            return None
        i, j = data.draw(st.sampled_from(pairs), label="pair")
        row[i], row[j] = row[j], row[i]
    elif kind == "fifo":
        pairs = [
            (i, j)
            for i, j in itertools.combinations(range(len(row)), 2)
            if row[i].op.is_recv and row[j].op.is_recv and row[i].peer == row[j].peer
        ]
        if not pairs:
            return None
        i, j = data.draw(st.sampled_from(pairs), label="pair")
        row[i], row[j] = row[j], row[i]
    else:  # "swap": any two actions; may or may not stay valid
        if len(row) < 2:
            return None
        i, j = data.draw(
            st.lists(st.integers(0, len(row) - 1), min_size=2, max_size=2, unique=True),
            label="pair",
        )
        row[i], row[j] = row[j], row[i]
    return _replace(schedule, stage, row)


@given(
    valid_schedules(),
    st.sampled_from(["drop", "duplicate", "peer", "order", "fifo", "swap"]),
    st.data(),
)
@settings(max_examples=300, deadline=None)
def test_corruptions_rejected(schedule: Schedule, kind: str, data: st.DataObject) -> None:
    corrupted = _corrupt(data, schedule, kind)
    assume(corrupted is not None)
    assert corrupted is not None
    expect_ok = _reference_ok(corrupted)
    if kind in ("duplicate", "peer", "order", "fifo"):
        assert not expect_ok
    if kind == "drop":
        # Dropping the only B of a 1x1 schedule leaves a valid forward-only schedule.
        lone_forward = corrupted.actions == ((Action(Op.FORWARD, 0),),)
        assert expect_ok == (lone_forward and corrupted.num_microbatches == 1)
    if expect_ok:
        validate(corrupted)
    else:
        with pytest.raises(ScheduleError) as info:
            validate(corrupted)
        text = str(info.value)
        assert corrupted.table().splitlines()[0] in text
        assert ("**" in text) == bool(info.value.marks)


@given(valid_schedules(), st.data())
@settings(max_examples=100, deadline=None)
def test_random_rewrites_agree_with_reference(schedule: Schedule, data: st.DataObject) -> None:
    # Shuffle one stage's actions entirely: mostly invalid, sometimes not.
    stage = data.draw(st.integers(0, schedule.num_stages - 1))
    row = data.draw(st.permutations(schedule.for_stage(stage)))
    corrupted = _replace(schedule, stage, list(row))
    if _reference_ok(corrupted):
        validate(corrupted)
    else:
        with pytest.raises(ScheduleError):
            validate(corrupted)
