"""The state transports (recovery/transport/): one conformance test over every implementation.

Each `StateTransport` -- over the process group, and copied out of the sender's memory on
one host -- delivers a state with every field set bit for bit (each field of
`recovery.state.FIELDS`, the fixtures of tests/test_worker_state.py), refuses a garbled
description and bytes changed in flight, and reports a peer that died mid-transfer as a
communication error (`is_comm_error`), the failure the runtime recovers from. What only
one of them does -- the same-host fallbacks, the digests taken ahead -- is in
tests/test_same_host.py; the wire format itself in tests/test_wire.py.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from parallelism import Topology
from parallelism.comm import GarbledMessage, StageComm
from recovery.errors import TransferCorrupted
from recovery.reference import differences
from recovery.state import FIELDS, WorkerState
from recovery.transport import (
    ProcessGroupTransport,
    SameHostTransport,
    StateTransport,
    same_host,
)
from recovery.worker.reports import is_comm_error
from tests.jobs import in_threads
from tests.test_comm import _pair
from tests.test_wire import _garbage
from tests.test_worker_state import blank, fields_of, source

TRANSPORTS: dict[str, type[StateTransport]] = {
    "process group": ProcessGroupTransport,
    "same host": SameHostTransport,
}
"""Every implementation of `StateTransport`: a new one is added here and passes it all."""


@pytest.fixture(params=list(TRANSPORTS))
def transport(request: pytest.FixtureRequest) -> type[StateTransport]:
    if request.param == "same host" and not same_host.usable():
        pytest.skip("this kernel does not allow process_vm_readv")
    return TRANSPORTS[request.param]


def _move(
    transport: type[StateTransport],
    src: WorkerState,
    dst: WorkerState,
    *,
    flip: int | None = None,
    sender: Any = None,
) -> tuple[Any, Any]:
    """Send ``src`` from rank 0 to ``dst`` on rank 1, each side a ``transport`` of its own
    comm (the sender's wrapped by ``sender``, if given); returns what each side returned
    or raised."""
    comms = _pair(Topology(2, 1))
    out = comms[0] if sender is None else sender(comms[0])
    try:
        sent, got = in_threads(
            [
                lambda: transport(cast(StageComm, out)).send(1, src, flip=flip),
                lambda: transport(comms[1]).recv(0, dst),
            ]
        )
    finally:
        for comm in comms:
            comm.close()
    return sent, got


def _implementations(cls: type[StateTransport]) -> set[type[StateTransport]]:
    return {sub for c in cls.__subclasses__() for sub in {c, *_implementations(c)}}


def test_every_implementation_is_listed() -> None:
    assert _implementations(StateTransport) == set(TRANSPORTS.values())


def test_a_state_with_every_field_set_arrives_bit_identical(
    transport: type[StateTransport],
) -> None:
    src, dst = source(), blank()
    want = fields_of(src)
    assert differences(fields_of(dst), want), "the blank worker must differ in every field"
    sent, got = _move(transport, src, dst)
    assert not isinstance(got, BaseException), got
    progress, received = got
    assert received == sent
    arrived = fields_of(WorkerState(dst.module, dst.optimizer, progress))
    for field in FIELDS:
        assert not differences(arrived[field], want[field], where=field), field


@pytest.mark.parametrize(
    "sent",
    [
        [torch.tensor([1 << 62])],  # an absurd header length
        [torch.tensor([12]), torch.frombuffer(bytearray(b"\xff\xfe{garbage}"), dtype=torch.uint8)],
        [
            torch.tensor([len(b'{"model":7}')]),
            torch.frombuffer(bytearray(b'{"model":7}'), dtype=torch.uint8),
        ],
    ],
    ids=["length", "not-json", "wrong-structure"],
)
def test_a_garbled_description_is_a_communication_error(
    transport: type[StateTransport], sent: list[torch.Tensor]
) -> None:
    """What a sender that died mid-message leaves where the description should be: the
    receiver gets a clean communication error, not an IndexError or an absurd allocation,
    and its worker is left as it was."""
    comms = _pair(Topology(2, 1))
    dst = blank()
    before = fields_of(dst)
    try:
        _, got = in_threads(
            [lambda: _garbage(comms[0], *sent), lambda: transport(comms[1]).recv(0, dst)]
        )
    finally:
        for comm in comms:
            comm.close()
    assert isinstance(got, GarbledMessage), got
    assert is_comm_error(got)
    assert not differences(fields_of(dst), before)


def test_a_bit_flipped_in_flight_is_refused(transport: type[StateTransport]) -> None:
    """[Note: checked transfers]: the receiver hashes what arrived and refuses it, naming
    the source and the tensor, and does not load the optimizer state."""
    src, dst = source(), blank()
    before = fields_of(dst)
    sent, got = _move(transport, src, dst, flip=3)
    assert isinstance(sent, int), sent
    assert isinstance(got, TransferCorrupted), got
    ((target, origin, tensors),) = got.found
    assert (target, origin) == (1, 0) and len(tensors) == 1
    assert not differences(fields_of(dst)["optimizer"], before["optimizer"])


class _Died(Exception):
    """The sender's death, as its own thread sees it."""


class _Dying:
    """A sender's comm that dies after its first header: the description is delivered,
    then its process groups are torn down, as a killed worker's are, before it sends
    anything more (the tensors, or its digests after an offer)."""

    def __init__(self, comm: StageComm) -> None:
        self._comm = comm
        self._sends = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends += 1
        if self._sends > 2:  # a header is two sends: its length, then its bytes
            self._comm.wait_sends()
            self._comm.close()
            raise _Died
        self._comm.isend(tensor, dst)


def test_a_peer_that_dies_mid_transfer_is_a_communication_error(
    transport: type[StateTransport],
) -> None:
    sent, got = _move(transport, source(), blank(), sender=_Dying)
    assert isinstance(sent, _Died), sent
    assert isinstance(got, ConnectionError | RuntimeError), got
    assert is_comm_error(got), got
