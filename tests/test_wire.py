"""The wire format: what workers send besides tensor bytes is JSON checked before any
allocation; garbage or a stranger's bytes are a communication error, never code run.
(A state transport's own description, garbled or not: tests/test_transport.py.)"""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism import Topology
from parallelism.comm import GarbledMessage, StageComm
from parallelism.comm import wire as comm_wire
from recovery import wire
from recovery.snapshots.packing import PackedState, pack_state, unpack_state
from recovery.state import Progress, Rebuild, WorkerState
from recovery.transport import recv_named
from recovery.wire import decode, encode, tensor_spec
from recovery.worker.keeper import SnapshotKeeper
from recovery.worker.reports import is_comm_error
from recovery.worker.table import TableWorker
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
    monkeypatch.setattr(comm_wire, "message_budget", lambda device: 1 << 62)  # a huge host
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


# -- the bounded parser and the budget of one message (issue 33 item 10) ------------------


@pytest.mark.parametrize("depth", [600, 900, 100_000])
def test_brackets_nested_past_the_recursion_limit_are_a_garbled_message(depth: int) -> None:
    """Hundreds of nested ``[`` used to escape as ``RecursionError`` -- read as a bug in
    user code, ending the job -- instead of a communication error."""
    with pytest.raises(GarbledMessage, match="nest") as err:
        decode(b"[" * depth + b"]" * depth)
    assert is_comm_error(err.value)


def test_the_parser_bounds_nesting_items_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bound on both sides of its limit (made small here, so the test is fast)."""
    monkeypatch.setattr(wire, "MAX_DEPTH", 5)
    monkeypatch.setattr(wire, "MAX_ITEMS", 100)
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 1000)
    assert decode(b"[[[[[]]]]]") == [[[[[]]]]]
    with pytest.raises(GarbledMessage, match="nest"):
        decode(b"[[[[[[]]]]]]")
    with pytest.raises(GarbledMessage, match="nest"):  # a dict is a level too
        decode(b'{"a":[[[[{"b":1}]]]]}')
    assert decode(b"[" + b"0," * 98 + b"0]") == [0] * 99  # 100 values, the list included
    with pytest.raises(GarbledMessage, match="values"):
        decode(b"[" + b"0," * 99 + b"0]")
    with pytest.raises(GarbledMessage, match="values"):  # a dict's keys count too
        decode(encode({str(i): i for i in range(60)}))
    assert decode(b" " * 997 + b"[1]") == [1]
    with pytest.raises(GarbledMessage, match="bytes"):
        decode(b" " * 998 + b"[1]")


class _Announcer:
    """A peer that announces sizes and sends nothing of what it announced: each ``recv``
    takes the next of ``values``; a receive past them means the receiver allocated what
    it should have refused."""

    def __init__(self, *values: torch.Tensor) -> None:
        self.values = list(values)
        self.wire = self.device = torch.device("cpu")
        self.rank = 1

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if not self.values:
            raise AssertionError(f"received into {tuple(tensor.shape)} {tensor.dtype}")
        value = self.values.pop(0)
        assert tensor.shape == value.shape, (tensor.shape, value.shape)
        return tensor.copy_(value)

    def recv_many(self, tensors: list[torch.Tensor], src: int) -> None:
        raise AssertionError(f"received into {len(tensors)} tensors")


def _header(obj: object) -> list[torch.Tensor]:
    blob = encode(obj)
    return [torch.tensor([len(blob)]), torch.frombuffer(bytearray(blob), dtype=torch.uint8)]


def test_a_description_over_the_message_budget_is_refused_before_it_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every tensor in bounds, their sum not: a description is one message, with one
    budget (a device's memory at most) for all the tensors it announces."""
    monkeypatch.setattr(comm_wire, "message_budget", lambda device: 1 << 20)
    model = [[f"w{i}", [100 << 10], "float32"] for i in range(3)]  # 400 KiB each
    with pytest.raises(GarbledMessage, match="budget") as err:
        recv_named(_Announcer(*_header({"model": model, "moments": {}})), 0)  # type: ignore[arg-type]
    assert is_comm_error(err.value)
    assert comm_wire.message_budget(torch.device("cpu")) == 1 << 20


def test_the_real_budget_is_the_devices_memory_at_most() -> None:
    cpu = torch.device("cpu")
    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < comm_wire.message_budget(cpu) <= pages


def test_a_peer_copy_announcing_more_than_the_budget_is_refused() -> None:
    """The peer-snapshot receive used to allocate up to 1 TiB as announced, raw."""
    over = comm_wire.message_budget(torch.device("cpu")) + 1
    with pytest.raises(GarbledMessage, match="budget") as err:
        SnapshotKeeper().receive(_Announcer(torch.tensor([100, over])), 0)  # type: ignore[arg-type]
    assert is_comm_error(err.value)


@pytest.mark.parametrize("count", [-1, "budget"])
def test_a_mirror_update_announcing_a_bad_size_is_refused(count: object) -> None:
    """The mirror exchange's sized receives allocated any announced count, raw (a
    negative one raised a ``RuntimeError`` from torch, read as a bug in user code)."""
    n = comm_wire.message_budget(torch.device("cpu")) // 8 + 1 if count == "budget" else count
    worker = TableWorker.__new__(TableWorker)
    worker.comm = _Announcer(torch.tensor([n]))  # type: ignore[assignment]
    with pytest.raises(GarbledMessage) as err:
        worker._recv_sized(0, torch.int64, comm_wire.ReceiveBudget(torch.device("cpu")))
    assert is_comm_error(err.value)


def test_an_activation_tuple_over_the_message_budget_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each tensor of a tuple in bounds, the tuple not: one budget for the whole tuple."""
    monkeypatch.setattr(comm_wire, "message_budget", lambda device: 1 << 20)
    comms = _pair(Topology(2, 1))
    part = torch.tensor([1, 0, 2, 0, 150_000, 0, 0, 0, 0, 0, 0, 0])  # 1 of 2: 600 KB

    def receive() -> object:
        try:
            return comms[1].recv_activation(0)
        finally:
            comms[1].close()

    try:
        _, got = in_threads([lambda: _garbage(comms[0], part, torch.zeros(150_000), part), receive])
        assert isinstance(got, GarbledMessage) and "budget" in str(got), got
    finally:
        for comm in comms:
            comm.close()
