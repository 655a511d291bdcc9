"""The timeout hierarchy (docs/timeouts.md): `Timeouts` refuses waits out of order, naming
both, the process groups are built with a backend timeout above the controller's, and
every wait a worker makes inside a call is shorter than the controller's wait on that
call."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism import Topology
from parallelism.comm import Rendezvous, StageComm, host_store
from recovery import Kill, SnapshotPolicy
from recovery.policy import RecoveryPolicy, Timeouts
from recovery.runtime import Phase
from recovery.snapshots import DurableStore
from tests.jobs import drive, make
from tests.workloads import mlp_spec


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


# -- waits inside waits -------------------------------------------------------------------

ODD = {
    "default": Timeouts(),
    "tiny hang": Timeouts(hang=0.5),
    "short save, long hang": Timeouts(save=5, hang=600, transfer=30, control=1),
    "long save, short rest": Timeouts(save=3600, hang=2, transfer=1, control=0.5, join=1),
    "long control": Timeouts(control=1000, save=1),
}


def _check_hierarchy(timeouts: Timeouts) -> None:
    nested = timeouts.nested()
    guarded = {(w.inner, w.outer) for w in nested}
    for inner in ("durable_write", "flush_snapshots", "prepare_recovery", "take_snapshot"):
        assert any(i.startswith(inner) for i, _ in guarded), (inner, guarded)
    for outer in ("collective", "start"):
        assert any(o == outer for _, o in guarded), (outer, guarded)
    for wait in nested:
        assert wait.inner_s < wait.outer_s, wait


@pytest.mark.parametrize("timeouts", list(ODD.values()), ids=list(ODD))
def test_every_inner_wait_is_shorter_than_the_one_guarding_it(timeouts: Timeouts) -> None:
    """The whole hierarchy, as the runtime uses it: each worker call's own waits (for its
    durable writes, for the peer exchange) against the controller's wait on that call, and
    the controller's clocks against the backend's."""
    _check_hierarchy(timeouts)


_SECONDS = st.floats(min_value=0.01, max_value=1e5, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({f: _SECONDS for f in ("start", "replace", "join", "hang",
                                                     "transfer", "save", "control")}))  # fmt: skip
def test_the_hierarchy_holds_for_any_valid_set(values: dict[str, float]) -> None:
    try:
        timeouts = Timeouts(**values)  # type: ignore[arg-type]
    except ValueError:
        return  # refused as out of order: never used
    _check_hierarchy(timeouts)


def test_durable_writes_that_never_finish_cost_no_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that stops answering: every durable write from step 2 on never lands. The
    next snapshots are skipped (each worker gives up waiting for its previous write within
    its call), a recovery's survivors leave the generation on time, the job ends: the only
    worker lost is the one killed."""
    release = threading.Event()
    real = DurableStore._finish

    def stuck(self: DurableStore, upload, step: int, *args):  # type: ignore[no-untyped-def]
        if step >= 2:
            release.wait(120)
        return real(self, upload, step, *args)

    monkeypatch.setattr(DurableStore, "_finish", stuck)
    policy = RecoveryPolicy(
        snapshots=SnapshotPolicy(peer_every=None, durable_every=2),
        timeouts=Timeouts(hang=2, save=2, control=1),
    )
    killed = Kill(step=5, stage=0, replica=1)
    controller, _ = make(
        mlp_spec(), Topology(2, 2), killed, policy=policy, snapshot_dir=str(tmp_path), steps=7
    )
    try:
        phases = drive(controller)
    finally:
        release.set()
    assert phases[-1] is Phase.FINISHED, controller.error
    assert [e.lost for e in controller.events] == [[(0, 1)]], controller.events
    assert controller.ledger.durable_steps == []  # nothing landed, and the job trained on
