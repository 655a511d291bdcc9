"""`StageComm` waits: slow peers are waited for, closed groups are given up on."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from parallelism import Topology
from parallelism.comm import (
    CommError,
    GarbledMessage,
    NcclSettings,
    Rendezvous,
    StageComm,
    abort_groups,
    from_wire,
    host_store,
    nccl_env,
    nccl_options,
    to_wire,
)
from parallelism.comm.gloo_sockets import _socket_inodes, _Transport
from parallelism.comm.groups import _abandonable
from recovery.errors import CallbackError
from recovery.worker.reports import is_comm_error


def _pair(top: Topology) -> list[StageComm]:
    store = host_store("127.0.0.1")
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 20)
    with ThreadPoolExecutor(top.world_size) as pool:
        futures = [
            pool.submit(StageComm, rdzv, top, r, "gloo", "127.0.0.1") for r in range(top.world_size)
        ]
        comms = [f.result(timeout=30) for f in futures]
    comms[0].keep = store  # type: ignore[attr-defined]  # the store lives as long as the groups
    return comms


def test_a_receive_waits_for_a_slow_sender_and_a_collective_for_a_slow_peer() -> None:
    """Waits longer than the 100 ms slices a collective is waited in still succeed:
    a pipeline receive (stage 0 -> 1) and a stage all-reduce (replica 0 and 1)."""
    recv_comms = _pair(Topology(2, 1))
    reduce_comms = _pair(Topology(1, 2))

    def slow_send() -> None:
        time.sleep(0.4)
        recv_comms[0].send_activation(torch.arange(6.0).reshape(2, 3), 1)
        recv_comms[0].wait_sends()

    def slow_reduce() -> None:
        time.sleep(0.4)
        work = reduce_comms[1].allreduce_stage(torch.ones(4))
        assert work is not None
        reduce_comms[1].wait(work)

    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(slow_send)
        got = recv_comms[1].recv_activation(0)
        sent.result(timeout=10)
        peer = pool.submit(slow_reduce)
        mine = torch.ones(4)
        work = reduce_comms[0].allreduce_stage(mine)
        assert work is not None
        reduce_comms[0].wait(work)
        peer.result(timeout=10)
    assert torch.equal(got, torch.arange(6.0).reshape(2, 3))
    assert torch.equal(mine, torch.full((4,), 2.0))
    for comm in recv_comms + reduce_comms:
        comm.close()


# -- NCCL groups that abort (checked on CPU with stand-ins; see [Note: NCCL groups that abort])


def test_the_nccl_environment_turns_the_watchdogs_killing_off() -> None:
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "OTHER": "x"}
    replaced = nccl_env(environ)
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert environ["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert environ["OTHER"] == "x"
    assert replaced == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_ENABLE_MONITORING": "",
        "TORCH_NCCL_BLOCKING_WAIT": "",
    }
    assert nccl_env(environ) == {}  # idempotent


def test_nccl_options_are_non_blocking_with_the_backstop_timeout() -> None:
    settings = NcclSettings(timeout=datetime.timedelta(seconds=600), device=torch.device("cpu"))
    opts = nccl_options(settings, SimpleNamespace(config=SimpleNamespace(blocking=-1)))
    assert opts._timeout == datetime.timedelta(seconds=600)
    assert opts.config.blocking == 0
    # A torch without ``config`` (or without ``blocking``) still gets its timeout.
    assert nccl_options(settings, SimpleNamespace())._timeout == settings.timeout
    assert not hasattr(
        nccl_options(settings, SimpleNamespace(config=SimpleNamespace())).config, "blocking"
    )


class _FakeGroup:
    def __init__(self, name: str, log: list[str], nccl: bool, broken: bool = False) -> None:
        self.name, self.log, self.broken = name, log, broken
        if nccl:
            self._group_start = lambda: log.append("group_start")
            self._group_end = lambda: log.append("group_end")

    def abort(self) -> None:
        if self.broken:
            raise RuntimeError("already broken")
        self.log.append(f"abort {self.name}")


def test_a_workers_nccl_groups_are_aborted_together_in_one_group_call() -> None:
    log: list[str] = []
    groups = [
        _FakeGroup("world", log, nccl=True),
        _FakeGroup("stage", log, nccl=True, broken=True),
        _FakeGroup("tied", log, nccl=True),
        _FakeGroup("side", log, nccl=False),
    ]
    abort_groups(groups)  # type: ignore[arg-type]
    assert log == ["group_start", "abort world", "abort tied", "group_end", "abort side"]


def test_gloo_groups_are_aborted_one_by_one() -> None:
    log: list[str] = []
    abort_groups([_FakeGroup("a", log, nccl=False), _FakeGroup("b", log, nccl=False)])  # type: ignore[list-item]
    assert log == ["abort a", "abort b"]


# -- staging between the compute device and the wire (compute on CUDA over Gloo)


def test_a_tensor_on_the_wire_device_is_not_staged() -> None:
    cpu = torch.device("cpu")
    t = torch.arange(6.0).reshape(2, 3)
    assert to_wire(t, cpu) is t
    assert from_wire(t, cpu) is t
    strided = t.t()  # a transposed view: sent contiguous, as isend does
    sent = to_wire(strided, cpu)
    assert sent.is_contiguous() and torch.equal(sent, strided)


def test_a_tensor_off_the_wire_device_is_staged_on_it() -> None:
    """The staging branch, with the meta device standing in for the other device (the CPU
    has no second device): a fresh tensor of the same shape and dtype on the wire's device,
    not pinned (pinning is for CUDA -> host only)."""
    t = torch.ones(3, 4, dtype=torch.float16)
    staged = to_wire(t, torch.device("meta"))
    assert staged is not t and staged.device.type == "meta"
    assert staged.shape == t.shape and staged.dtype == t.dtype
    assert from_wire(staged, torch.device("meta")) is staged


def test_cutting_the_transport_spares_a_socket_that_reused_a_listed_fd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race of threads that leave one generation while others form the next.

    A worker's `_Transport` lists its sockets by fd; another thread may close one of them
    and get the same fd number for a new socket (its store client, the next generation's
    Gloo pair) between the listing and the cut. Only the listed socket may be shut down:
    here the listing is made stale on purpose and the new socket must keep working.
    """
    listed, listed_peer = socket.socketpair()
    kept, kept_peer = socket.socketpair()
    fd = listed.fileno()
    stale = _socket_inodes()  # the listing, taken while ``fd`` was still the listed socket
    transport = _Transport.__new__(_Transport)
    transport._sockets = {fd: stale[fd], kept.fileno(): stale[kept.fileno()]}
    reused, reused_peer = socket.socketpair()
    listed.detach()
    os.dup2(reused.fileno(), fd)  # ``fd`` now names another socket, as after close + reuse
    monkeypatch.setattr("parallelism.comm.gloo_sockets._socket_inodes", lambda: dict(stale))
    try:
        transport.shut_down()
        reused_peer.sendall(b"x")
        assert os.read(fd, 1) == b"x"  # the socket that took the fd still works
        assert kept_peer.recv(1) == b""  # the listed socket that is still open was cut
    finally:
        os.close(fd)
        for s in (listed_peer, kept, kept_peer, reused, reused_peer):
            s.close()


def test_a_formation_waiting_on_a_peer_that_never_comes_is_abandoned_when_cancelled() -> None:
    """[Note: abandoning a formation]: a joiner stuck forming its groups (here: its peer
    never joins) gives up as soon as it is told to, with a communication error, instead of
    waiting out the join timeout (20 s here)."""
    store = host_store("127.0.0.1")
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 20)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        StageComm(rdzv, Topology(1, 2), 0, "gloo", "127.0.0.1", cancel=cancel)
    assert time.perf_counter() - start < 3.0
    assert is_comm_error(info.value), info.value


def test_an_abandonable_formation_returns_the_group_or_its_own_error() -> None:
    assert _abandonable(lambda: "group", threading.Event()) == "group"

    def broken() -> None:
        raise ValueError("bad options")

    with pytest.raises(ValueError, match="bad options"):
        _abandonable(broken, threading.Event())


def test_a_group_formed_under_the_join_timeout_times_out_its_operations_after_the_collective_one() -> (
    None
):
    """Formed with a 20 s join timeout, a group's operations keep the collective timeout."""
    store = host_store("127.0.0.1")
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 20, collective_s=1.5)
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(StageComm, rdzv, Topology(1, 2), r, "gloo", "127.0.0.1") for r in range(2)
        ]
        comms = [f.result(timeout=30) for f in futures]
    try:
        start = time.perf_counter()
        work = comms[0]._stage.allreduce([torch.ones(2)])  # replica 1 never takes part
        with pytest.raises(RuntimeError, match=r"[Tt]imed out"):
            work.wait()
        assert 1.0 < time.perf_counter() - start < 10.0
    finally:
        for c in comms:
            c.close()


def test_a_rendezvous_carries_a_fresh_secret_that_its_repr_hides() -> None:
    """Each generation's workers share a secret the controller hands them with the
    rendezvous (through Ray, never the store: [Note: the vote's handshake])."""
    one, two = Rendezvous("127.0.0.1", 1, "gen1", 20), Rendezvous("127.0.0.1", 1, "gen2", 20)
    assert len(one.secret) == 32 and one.secret != two.secret
    assert one.secret.hex() not in repr(one) and "secret" not in repr(one)
    assert pickle.loads(pickle.dumps(one)) == one  # as Ray hands it over


def test_communication_errors_are_told_apart_by_type_not_by_their_words() -> None:
    """[Note: communication errors are marked at the source]: what says "connection" or
    "timed out" is not thereby a peer's failure; what a call to peers raised is one."""
    for users in (
        OSError("Connection reset"),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError("read timed out"),
        RuntimeError("[gloo] Connection closed by peer"),  # words alone, not marked
        CallbackError("batches(2, 1, 2)", 2, 0, 1, ConnectionResetError("reset")),
    ):
        assert not is_comm_error(users), users
    for peers in (
        CommError("process group used after close()"),
        GarbledMessage("a wire header of 0 bytes"),
        dist.DistBackendError("NCCL error: remote process exited"),
    ):
        assert is_comm_error(peers), peers


def test_a_peer_lost_mid_receive_is_a_comm_error_with_the_backends_as_its_cause() -> None:
    comms = _pair(Topology(2, 1))
    comms[0].close()  # the peer goes
    try:
        with pytest.raises(CommError) as info:
            comms[1].recv(torch.empty(4), 0)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert not isinstance(info.value.__cause__, CommError)  # Gloo's own, kept
        with pytest.raises(CommError, match="after close"):
            comms[0].recv(torch.empty(4), 1)
    finally:
        comms[1].close()
