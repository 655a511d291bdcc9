"""`Mesh`: the commit vote's all-gather over plain TCP ([Note: the vote's own connections])."""

from __future__ import annotations

import datetime
import math
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from parallelism.comm import host_store
from parallelism.mesh import Mesh
from recovery.worker.reports import is_comm_error

SHORT = datetime.timedelta(seconds=20)


def _store(host: dist.TCPStore) -> dist.Store:
    client = dist.TCPStore("127.0.0.1", host.port, None, False, SHORT)
    return dist.PrefixStore("gen0", client)


def _meshes(size: int) -> tuple[list[Mesh], dist.TCPStore]:
    host = host_store("127.0.0.1")
    with ThreadPoolExecutor(size) as pool:
        futures = [
            pool.submit(Mesh, _store(host), i, size, "127.0.0.1", SHORT) for i in range(size)
        ]
        return [f.result(timeout=30) for f in futures], host


def _gather_all(meshes: list[Mesh], rows: list[list[float]]) -> list[object]:
    with ThreadPoolExecutor(len(meshes)) as pool:
        futures = [pool.submit(m.allgather, r, SHORT) for m, r in zip(meshes, rows, strict=True)]
        out: list[object] = []
        for f in futures:
            try:
                out.append(f.result(timeout=30))
            except Exception as exc:
                out.append(exc)
        return out


def test_every_worker_gets_every_row_bit_for_bit_exchange_after_exchange() -> None:
    meshes, _host = _meshes(4)
    try:
        for k in range(3):
            rows = [[1.0, 0.1 * i + k, -0.0, 1e-310, math.inf] for i in range(4)]
            got = _gather_all(meshes, rows)
            expected = [tuple(r) for r in rows]
            for result in got:
                assert isinstance(result, list)
                assert [struct.pack("<5d", *r) for r in result] == [
                    struct.pack("<5d", *r) for r in expected
                ]
        nan = _gather_all(meshes, [[math.nan]] * 4)
        assert all(math.isnan(r[0]) for result in nan for r in result)  # type: ignore[attr-defined]
    finally:
        for m in meshes:
            m.shut_down()


def test_a_generation_of_one_gathers_its_own_row() -> None:
    (mesh,), _host = _meshes(1)
    assert mesh.allgather([3.0, 4.0], SHORT) == [(3.0, 4.0)]


def test_a_peer_that_leaves_fails_every_waiting_reader_at_once() -> None:
    """Worker 2 never votes and shuts its connections down (as a dying worker's sockets
    close): workers 0 and 1, waiting for its row, fail with a communication error well
    within the timeout."""
    meshes, _host = _meshes(3)
    try:
        threading.Timer(0.3, meshes[2].shut_down).start()
        start = time.perf_counter()
        got = _gather_all(meshes[:2], [[1.0], [2.0]])
        assert time.perf_counter() - start < 5.0
        for result in got:
            assert isinstance(result, ConnectionError), result
            assert is_comm_error(result)
            assert "index 2" in str(result)
    finally:
        for m in meshes:
            m.shut_down()


def test_shutting_down_wakes_this_workers_own_reader() -> None:
    """The worker's teardown runs on another thread than its step ([Note: tearing down on
    failure]): it wakes the step's read of a live but silent peer at once."""
    meshes, _host = _meshes(2)
    try:
        threading.Timer(0.3, meshes[0].shut_down).start()
        start = time.perf_counter()
        with pytest.raises(ConnectionError, match="torn down") as info:
            meshes[0].allgather([1.0], SHORT)
        assert time.perf_counter() - start < 5.0
        assert is_comm_error(info.value)
        with pytest.raises(ConnectionError, match="torn down"):
            meshes[0].allgather([1.0], SHORT)  # and stays down
    finally:
        meshes[1].shut_down()


def test_a_silent_peer_times_the_exchange_out() -> None:
    meshes, _host = _meshes(2)
    try:
        start = time.perf_counter()
        with pytest.raises(ConnectionError, match=r"timed out .* indices \[1\]") as info:
            meshes[0].allgather([1.0], datetime.timedelta(seconds=0.5))
        assert 0.4 < time.perf_counter() - start < 5.0
        assert is_comm_error(info.value)
    finally:
        for m in meshes:
            m.shut_down()


def test_workers_out_of_step_fail_loudly_instead_of_pairing_the_wrong_rows() -> None:
    meshes, _host = _meshes(2)
    try:
        # Worker 1 sends a row of another length: not this exchange's.
        got = _gather_all(meshes, [[1.0, 2.0], [1.0]])
        assert all(isinstance(r, ConnectionError) for r in got), got
        assert "expected exchange 0 of" in str(got[0])
    finally:
        for m in meshes:
            m.shut_down()


def test_a_formation_whose_peer_never_comes_is_abandoned_when_cancelled() -> None:
    host = host_store("127.0.0.1")
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match="abandoned") as info:
        Mesh(_store(host), 0, 2, "127.0.0.1", SHORT, cancel)
    assert time.perf_counter() - start < 3.0
    assert is_comm_error(info.value)


def test_a_stranger_or_a_stale_peer_connecting_during_formation_is_turned_away() -> None:
    """Something else reaching the listener -- a port scan, or a worker of an earlier
    generation whose peer's port the listener reused, naming the right index but not this
    listener's token -- is dropped and the real peer still joins."""
    host = host_store("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(Mesh, _store(host), 0, 2, "127.0.0.1", SHORT)
        address = _store(host).get("mesh/0").decode().split()
        strangers = [socket.create_connection((address[0], int(address[1]))) for _ in range(3)]
        strangers[0].sendall(struct.pack("<I", 7))  # a few bytes, then nothing
        strangers[1].sendall(struct.pack("<I16s", 1, b"\0" * 16))  # index 1, another token
        strangers[2].sendall(struct.pack("<I16s", 9, bytes.fromhex(address[2])))  # no index 9
        second = Mesh(_store(host), 1, 2, "127.0.0.1", SHORT)
        mesh0 = first.result(timeout=30)
    try:
        for s in strangers:
            s.settimeout(5)
            assert s.recv(16) == b""  # closed without an answer
        assert _gather_all([mesh0, second], [[0.0], [1.0]]) == [[(0.0,), (1.0,)]] * 2
    finally:
        for s in strangers:
            s.close()
        mesh0.shut_down()
        second.shut_down()
