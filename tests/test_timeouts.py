"""The timeout hierarchy (docs/timeouts.md): `Timeouts` refuses waits out of order, naming
both, and the process groups are built with a backend timeout above the controller's."""

from __future__ import annotations

from datetime import timedelta

import pytest

from parallelism import Topology
from parallelism.comm import Rendezvous, StageComm, host_store
from recovery.policy import RecoveryPolicy, Timeouts


def test_the_defaults_are_in_order_and_the_backend_waits_longest() -> None:
    t = Timeouts()
    assert t.replace < t.start
    assert t.backend_timeout == timedelta(seconds=600)  # twice transfer (300 s)
    assert t.backend_timeout > max(t.hang, t.transfer)


@pytest.mark.parametrize(
    ("kwargs", "shorter", "longer"),
    [
        ({"replace": 300, "start": 300}, "replace", "start"),
        ({"replace": 400}, "replace", "start"),
        ({"hang": 30, "collective": 20}, "hang", "collective"),
        ({"hang": 30, "collective": 30}, "hang", "collective"),
        ({"transfer": 700, "collective": 650}, "transfer", "collective"),
    ],
)
def test_waits_out_of_order_are_refused_naming_both(
    kwargs: dict[str, float], shorter: str, longer: str
) -> None:
    with pytest.raises(ValueError, match="must be shorter than") as info:
        Timeouts(**kwargs)  # type: ignore[arg-type]
    text = str(info.value)
    assert f"timeouts.{shorter}" in text and f"timeouts.{longer}" in text
    assert text.index(f"timeouts.{shorter}") < text.index(f"timeouts.{longer}")


def test_timeouts_given_as_a_mapping_are_checked_too() -> None:
    with pytest.raises(ValueError, match=r"timeouts\.hang .* timeouts\.collective"):
        RecoveryPolicy(timeouts={"hang": 900, "collective": 100})
    with pytest.raises(ValueError, match=r"timeouts\.replace .* timeouts\.start"):
        RecoveryPolicy(timeouts={"replace": 301})


def test_the_backend_timeout_follows_a_raised_hang_timeout() -> None:
    """Left unset, ``collective`` is derived, so raising ``hang`` alone is never refused."""
    policy = RecoveryPolicy(timeouts=Timeouts(hang=900))
    assert policy.timeouts.collective is None
    assert policy.timeouts.backend_timeout == timedelta(seconds=1800)
    assert RecoveryPolicy(timeouts=Timeouts(hang=0.5)).timeouts.backend_timeout == timedelta(
        seconds=600
    )
    assert Timeouts(collective=45, hang=1, transfer=2).backend_timeout == timedelta(seconds=45)


def test_the_tiny_timeouts_tests_use_are_still_valid() -> None:
    for policy in (
        RecoveryPolicy(timeouts=Timeouts(hang=0.5)),
        RecoveryPolicy(timeouts=Timeouts(hang=3.0)),
        RecoveryPolicy(timeouts=Timeouts(replace=7)),
        RecoveryPolicy(timeouts=Timeouts(control=0.5)),  # type: ignore[arg-type]
    ):
        assert policy.timeouts.backend_timeout > policy.timeouts.hang


def test_the_groups_are_built_with_the_collective_timeout_not_the_join_timeout() -> None:
    store = host_store("127.0.0.1")
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 20, collective_s=7)
    comm = StageComm(rdzv, Topology(1, 1), 0, "gloo", "127.0.0.1", side_group=True)
    try:
        assert comm.world.options._timeout == timedelta(seconds=7)
        assert comm._side.options._timeout == timedelta(seconds=7)  # type: ignore[union-attr]
    finally:
        comm.close()
    # Without one, the join timeout as before (a Rendezvous built outside the controller).
    rdzv = Rendezvous("127.0.0.1", store.port, "gen1", 20)
    comm = StageComm(rdzv, Topology(1, 1), 0, "gloo", "127.0.0.1")
    try:
        assert comm.world.options._timeout == timedelta(seconds=20)
    finally:
        comm.close()
