"""The wire format: what workers send besides tensor bytes is JSON checked before any
allocation; garbage or a stranger's bytes are a communication error, never code run.
(A state transport's own description, garbled or not: tests/test_transport.py.)"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism import Topology
from parallelism.comm import GarbledMessage, StageComm
from recovery.snapshots.packing import PackedState, pack_state, unpack_state
from recovery.state import Progress, Rebuild, WorkerState
from recovery.transport import recv_named
from recovery.wire import decode, encode, tensor_spec
from recovery.worker.reports import is_comm_error
from tests.jobs import in_threads
from tests.test_comm import _pair


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, betas=(0.9, 0.95))
    module(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return module, optimizer


def test_an_optimizer_state_round_trips_exactly() -> None:
    _, optimizer = _trained()
    state = optimizer.state_dict()
    progress = Progress(4, Rebuild(2, 1.1, None, 0))
    back = decode(encode({**state, "progress": progress, "extra": {"at": None, "inf": math.inf}}))
    assert back["param_groups"] == state["param_groups"]  # tuples (betas) stay tuples
    assert back["param_groups"][0]["betas"] == (0.9, 0.95)
    assert back["progress"] == progress  # a record, nested records included
    assert back["extra"] == {"at": None, "inf": math.inf}
    for index, entry in state["state"].items():  # int keys survive
        for key, value in entry.items():
            assert torch.equal(back["state"][index][key], value) or value.numel() > 64


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_any_bytes_decode_or_raise_garbled_message(data: bytes) -> None:
    try:
        decode(data)
    except GarbledMessage as err:
        assert is_comm_error(err)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ([-1, 4], "float32"),
        ([1 << 30, 1 << 30], "float32"),
        ([2], "object"),
        ("ab", "float32"),
        ([True], "float32"),
        ([2.5], "float32"),
    ],
)
def test_a_shape_is_checked_before_it_is_allocated(shape: object, dtype: object) -> None:
    with pytest.raises(GarbledMessage):
        tensor_spec(shape, dtype)


def test_a_pickle_is_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (Path.touch, (marker,))

    payload = pickle.dumps(Exploit())
    with pytest.raises(GarbledMessage):
        decode(payload)
    with pytest.raises(GarbledMessage):
        PackedState.from_parts(payload, torch.zeros(0, dtype=torch.uint8))
    assert not marker.exists()


def test_a_packed_snapshot_header_round_trips_and_garbage_is_refused() -> None:
    module, optimizer = _trained()
    progress = Progress(7, Rebuild(5, 1.1, None, 2))
    packed = pack_state(WorkerState(module, optimizer, progress))
    again = PackedState.from_parts(packed.header(), packed.data.clone())
    other, other_opt = _trained()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    assert unpack_state(again, WorkerState(other, other_opt, Progress())) == progress
    for a, b in zip(module.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    bad = packed.header().replace(b'"nbytes":', b'"nbytes":1', 1)  # a slot that does not fit
    with pytest.raises(GarbledMessage, match="does not fit"):
        PackedState.from_parts(bad, packed.data)


def _garbage(sender: StageComm, *tensors: torch.Tensor) -> None:
    for t in tensors:
        sender.isend(t, 1)
    sender.wait_sends()


def test_a_garbage_activation_header_is_a_communication_error() -> None:
    comms = _pair(Topology(2, 1))
    header = torch.tensor([3, 0, 0, 1, 1 << 40, 1 << 40, 1 << 40, 0, 0, 0, 0, 0])
    try:
        _, got = in_threads(
            [lambda: _garbage(comms[0], header), lambda: comms[1].recv_activation(0)]
        )
        assert isinstance(got, GarbledMessage) and "activation header" in str(got)
    finally:
        for comm in comms:
            comm.close()


def test_a_tuple_activation_keeps_which_tensors_need_gradients() -> None:
    comms = _pair(Topology(2, 1))
    hidden = torch.randn(2, 3, requires_grad=True) * 2  # requires grad (not a leaf)
    mask = torch.triu(torch.ones(3, 3))
    try:
        _, got = in_threads(
            [
                lambda: (comms[0].send_activation((hidden, mask), 1), comms[0].wait_sends()),
                lambda: comms[1].recv_activation(0),
            ]
        )
        assert isinstance(got, tuple) and len(got) == 2
        assert torch.equal(got[0], hidden.detach()) and got[0].requires_grad
        assert torch.equal(got[1], mask) and not got[1].requires_grad
    finally:
        for comm in comms:
            comm.close()


def test_an_activation_header_whose_tuple_size_changes_midway_is_garbled() -> None:
    """The headers of one tuple all announce its size; one that disagrees would make the
    receiver stop early (dropping tensors) or read on into the next message."""
    comms = _pair(Topology(2, 1))
    first = torch.tensor([1, 0, 3, 0, 2, 0, 0, 0, 0, 0, 0, 0])  # 1 of a 3-tuple: 2 floats
    second = torch.tensor([1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0])  # ... then "a single tensor"

    def receive() -> object:
        try:
            return comms[1].recv_activation(0)
        finally:  # the sender's last send is never read: cut it loose now, not at Gloo's timeout
            comms[1].close()

    try:
        _, got = in_threads(
            [lambda: _garbage(comms[0], first, torch.zeros(2), second, torch.zeros(2)), receive]
        )
        assert isinstance(got, GarbledMessage) and "activation header" in str(got)
        assert is_comm_error(got)
    finally:
        for comm in comms:
            comm.close()


def test_a_header_in_bounds_that_cannot_be_allocated_is_a_communication_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In bounds is not possible: 2^36 float64 elements (512 GiB) pass the activation
    header's bounds, and a failed allocation must not read as a bug in user code. The
    allocator is a stand-in that refuses anything over 1 GiB, as a real one would."""
    real_empty = torch.empty

    def empty(*size: object, **kwargs: object) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        dtype = kwargs.get("dtype", torch.float32)
        if math.prod(shape) * real_empty((), dtype=dtype).element_size() > 1 << 30:  # type: ignore[arg-type]
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")
        return real_empty(*size, **kwargs)  # type: ignore[call-overload, no-any-return]

    comms = _pair(Topology(2, 1))
    monkeypatch.setattr(torch, "empty", empty)
    header = torch.tensor([2, 3, 0, 0, 1 << 18, 1 << 18, 0, 0, 0, 0, 0, 0])  # float64
    blob = encode({"model": [["w", [1 << 20, 1 << 18], "float32"]], "moments": {}})
    state_header = [torch.tensor([len(blob)]), torch.frombuffer(bytearray(blob), dtype=torch.uint8)]
    try:
        _, got = in_threads(
            [lambda: _garbage(comms[0], header), lambda: comms[1].recv_activation(0)]
        )
        assert isinstance(got, GarbledMessage) and "cannot be allocated" in str(got)
        assert is_comm_error(got)
        _, got = in_threads(
            [lambda: _garbage(comms[0], *state_header), lambda: recv_named(comms[1], 0)]
        )
        assert isinstance(got, GarbledMessage) and "cannot be allocated" in str(got)
        assert is_comm_error(got)
    finally:
        for comm in comms:
            comm.close()
