"""The controller's decisions, as pure functions (recovery/runtime/decisions.py): no runtime."""

from __future__ import annotations

import pytest

from recovery.runtime.decisions import (
    COMM_BACKOFF_S,
    MAX_COMM_BACKOFF_S,
    AtBoundary,
    OnFailure,
    Replace,
    Retry,
    at_boundary,
    on_comm_error,
    on_failure,
    on_interruption,
    replacement,
)


def test_a_boundary_finishes_at_the_target_before_growing() -> None:
    assert at_boundary(10, 10, missing=True, spares_ready=True) is AtBoundary.FINISH
    assert at_boundary(3, 10, missing=True, spares_ready=True) is AtBoundary.GROW
    assert at_boundary(3, 10, missing=True, spares_ready=False) is AtBoundary.STEP
    assert at_boundary(3, 10, missing=False, spares_ready=False) is AtBoundary.STEP


def test_the_backoff_doubles_up_to_its_cap_and_gives_up_past_the_retries() -> None:
    delays = [on_comm_error(n, retries=8).delay_s for n in range(1, 9)]
    assert delays[:3] == [COMM_BACKOFF_S, 2 * COMM_BACKOFF_S, 4 * COMM_BACKOFF_S]
    assert max(delays) == MAX_COMM_BACKOFF_S and delays == sorted(delays)
    assert on_comm_error(3, retries=3).decision is Retry.RETRY
    assert on_comm_error(4, retries=3) == on_comm_error(4, retries=3)
    assert on_comm_error(4, retries=3).decision is Retry.GIVE_UP
    assert on_comm_error(1, retries=0).decision is Retry.GIVE_UP


def test_recoveries_stop_at_the_policy_cap_only() -> None:
    assert on_failure(100, None) is OnFailure.RECOVER
    assert on_failure(1, 2) is OnFailure.RECOVER
    assert on_failure(2, 2) is OnFailure.GIVE_UP


def test_an_interruption_is_replanned_unless_hopeless() -> None:
    assert on_interruption(None) is Retry.RETRY
    assert on_interruption("rank 3's workers died 8 times") is Retry.GIVE_UP


@pytest.mark.parametrize(
    ("elastic", "shrinkable", "cold", "to_start", "no_room", "expected"),
    [
        (False, True, False, True, False, Replace.START),  # not elastic: wait for new workers
        (True, True, False, True, False, Replace.SHRINK),  # elastic: never stall on a cold start
        (True, True, False, False, False, Replace.START),  # nothing to start: renewed blanks
        (True, False, False, True, False, Replace.START),  # a plan that cannot shrink
        (True, True, True, True, False, Replace.START),  # the restart baseline comes back cold
        (True, True, False, True, True, Replace.SHRINK),  # no room: train on without them
        (False, True, False, True, True, Replace.GIVE_UP),
        (True, True, True, True, True, Replace.GIVE_UP),
    ],
)
def test_replacement(
    elastic: bool, shrinkable: bool, cold: bool, to_start: bool, no_room: bool, expected: Replace
) -> None:
    got = replacement(
        elastic=elastic, shrinkable=shrinkable, cold=cold, to_start=to_start, no_room=no_room
    )
    assert got is expected
