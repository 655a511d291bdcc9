"""`CommitVote`: the commit vote's all-gather over a tree of plain TCP connections
([Note: the vote's own connections])."""

from __future__ import annotations

import datetime
import math
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from parallelism.comm import host_store
from parallelism.comm.gloo_sockets import _socket_inodes
from parallelism.commit_vote import FANOUT, CommitVote, tree_depth
from recovery.worker.reports import is_comm_error

SHORT = datetime.timedelta(seconds=20)


def _store(host: dist.TCPStore) -> dist.Store:
    client = dist.TCPStore("127.0.0.1", host.port, None, False, SHORT)
    return dist.PrefixStore("gen0", client)


def _votes(size: int, fanout: int = FANOUT) -> tuple[list[CommitVote], dist.TCPStore]:
    host = host_store("127.0.0.1")
    store = _store(host)  # one client for all: a TCPStore client serialises its calls
    with ThreadPoolExecutor(size) as pool:
        futures = [
            pool.submit(CommitVote, store, i, size, "127.0.0.1", SHORT, fanout=fanout)
            for i in range(size)
        ]
        return [f.result(timeout=30) for f in futures], host


def _gather_all(votes: list[CommitVote], rows: list[list[float]]) -> list[object]:
    with ThreadPoolExecutor(len(votes)) as pool:
        futures = [pool.submit(v.allgather, r, SHORT) for v, r in zip(votes, rows, strict=True)]
        out: list[object] = []
        for f in futures:
            try:
                out.append(f.result(timeout=30))
            except Exception as exc:
                out.append(exc)
        return out


def test_every_worker_gets_every_row_bit_for_bit_exchange_after_exchange() -> None:
    votes, _host = _votes(4)
    try:
        for k in range(3):
            rows = [[1.0, 0.1 * i + k, -0.0, 1e-310, math.inf] for i in range(4)]
            got = _gather_all(votes, rows)
            expected = [tuple(r) for r in rows]
            for result in got:
                assert isinstance(result, list)
                assert [struct.pack("<5d", *r) for r in result] == [
                    struct.pack("<5d", *r) for r in expected
                ]
        nan = _gather_all(votes, [[math.nan]] * 4)
        assert all(math.isnan(r[0]) for result in nan for r in result)  # type: ignore[attr-defined]
    finally:
        for v in votes:
            v.shut_down()


def test_a_generation_of_one_gathers_its_own_row() -> None:
    (vote,), _host = _votes(1)
    assert vote.allgather([3.0, 4.0], SHORT) == [(3.0, 4.0)]


def test_a_peer_that_leaves_fails_every_waiting_reader_at_once() -> None:
    """Worker 2 never votes and shuts its connections down (as a dying worker's sockets
    close): workers 0 and 1, waiting for its row, fail with a communication error well
    within the timeout."""
    votes, _host = _votes(3)
    try:
        threading.Timer(0.3, votes[2].shut_down).start()
        start = time.perf_counter()
        got = _gather_all(votes[:2], [[1.0], [2.0]])
        assert time.perf_counter() - start < 5.0
        for result in got:
            assert isinstance(result, ConnectionError), result
            assert is_comm_error(result)
            assert "index 2" in str(result)
    finally:
        for v in votes:
            v.shut_down()


def test_shutting_down_wakes_this_workers_own_reader() -> None:
    """The worker's teardown runs on another thread than its step ([Note: tearing down on
    failure]): it wakes the step's read of a live but silent peer at once."""
    votes, _host = _votes(2)
    try:
        threading.Timer(0.3, votes[0].shut_down).start()
        start = time.perf_counter()
        with pytest.raises(ConnectionError, match="torn down") as info:
            votes[0].allgather([1.0], SHORT)
        assert time.perf_counter() - start < 5.0
        assert is_comm_error(info.value)
        with pytest.raises(ConnectionError, match="torn down"):
            votes[0].allgather([1.0], SHORT)  # and stays down
    finally:
        votes[1].shut_down()


def test_a_silent_peer_times_the_exchange_out() -> None:
    votes, _host = _votes(2)
    try:
        start = time.perf_counter()
        with pytest.raises(ConnectionError, match=r"timed out .* indices \[1\]") as info:
            votes[0].allgather([1.0], datetime.timedelta(seconds=0.5))
        assert 0.4 < time.perf_counter() - start < 5.0
        assert is_comm_error(info.value)
    finally:
        for v in votes:
            v.shut_down()


def test_workers_out_of_step_fail_loudly_instead_of_pairing_the_wrong_rows() -> None:
    votes, _host = _votes(2)
    try:
        # Worker 1 sends a row of another length: not this exchange's.
        got = _gather_all(votes, [[1.0, 2.0], [1.0]])
        assert all(isinstance(r, ConnectionError) for r in got), got
        assert "expected exchange 0 of" in str(got[0])
    finally:
        for v in votes:
            v.shut_down()


def test_a_formation_whose_peer_never_comes_is_abandoned_when_cancelled() -> None:
    host = host_store("127.0.0.1")
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match="abandoned") as info:
        CommitVote(_store(host), 0, 2, "127.0.0.1", SHORT, cancel)
    assert time.perf_counter() - start < 3.0
    assert is_comm_error(info.value)


def test_a_stranger_or_a_stale_peer_connecting_during_formation_is_turned_away() -> None:
    """Something else reaching the listener -- a port scan, or a worker of an earlier
    generation whose peer's port the listener reused, naming the right index but not this
    listener's token -- is dropped and the real peer still joins."""
    host = host_store("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(CommitVote, _store(host), 0, 2, "127.0.0.1", SHORT)
        address = _store(host).get("vote/0").decode().split()
        strangers = [socket.create_connection((address[0], int(address[1]))) for _ in range(3)]
        strangers[0].sendall(struct.pack("<I", 7))  # a few bytes, then nothing
        strangers[1].sendall(struct.pack("<I16s", 1, b"\0" * 16))  # index 1, another token
        strangers[2].sendall(struct.pack("<I16s", 9, bytes.fromhex(address[2])))  # no index 9
        second = CommitVote(_store(host), 1, 2, "127.0.0.1", SHORT)
        vote0 = first.result(timeout=30)
    try:
        for s in strangers:
            s.settimeout(5)
            assert s.recv(16) == b""  # closed without an answer
        assert _gather_all([vote0, second], [[0.0], [1.0]]) == [[(0.0,), (1.0,)]] * 2
    finally:
        for s in strangers:
            s.close()
        vote0.shut_down()
        second.shut_down()


@pytest.mark.parametrize(("size", "fanout"), [(7, 2), (10, 3), (17, FANOUT)])
def test_every_shape_of_tree_gathers_every_row_in_index_order(size: int, fanout: int) -> None:
    """Full and ragged trees, one to three levels deep: every worker ends with every row."""
    votes, _host = _votes(size, fanout)
    try:
        for k in range(2):
            rows = [[float(i), float(k), -1.5 * i] for i in range(size)]
            got = _gather_all(votes, rows)
            assert got == [[tuple(r) for r in rows]] * size
    finally:
        for v in votes:
            v.shut_down()


def test_the_tree_is_as_deep_as_the_note_says() -> None:
    assert [tree_depth(n) for n in (1, 2, 17, 18, 273, 274, 16_384)] == [0, 1, 1, 2, 2, 3, 4]
    assert tree_depth(7, 2) == 2 and tree_depth(8, 2) == 3


def test_connections_per_worker_are_bounded_by_the_fanout_and_n_minus_1_in_all() -> None:
    """Counted twice: by each vote, and as the sockets this process opened (both ends of
    every connection are here; the listeners are closed once the tree is formed)."""
    size, fanout = 16, 3
    host = host_store("127.0.0.1")
    store = _store(host)
    before = len(_socket_inodes())
    with ThreadPoolExecutor(size) as pool:
        futures = [
            pool.submit(CommitVote, store, i, size, "127.0.0.1", SHORT, fanout=fanout)
            for i in range(size)
        ]
        votes = [f.result(timeout=30) for f in futures]
    try:
        assert len(_socket_inodes()) - before == 2 * (size - 1)
        assert max(v.connections for v in votes) <= fanout + 1
        assert sum(v.connections for v in votes) == 2 * (size - 1)
        assert {v.parent for v in votes} == {None, *range(5)}  # 0..4 have children
    finally:
        for v in votes:
            v.shut_down()


@pytest.mark.parametrize(
    ("victim", "where"), [(6, "a leaf"), (1, "an inner worker"), (0, "the root")]
)
@pytest.mark.parametrize("when", ["before the vote", "during the vote"])
def test_a_dead_worker_anywhere_in_the_tree_fails_every_survivor_promptly(
    victim: int, where: str, when: str
) -> None:
    """Seven workers in a binary tree (0; 1, 2; 3..6). The victim never votes and its
    connections close, as a dying worker's do, before the others vote or while they wait.
    Every survivor fails with a communication error that names the victim -- those not
    next to it learn of it through the FAIL passed along the tree -- well within the
    exchange's timeout (20 s), and the vote stays failed."""
    votes, _host = _votes(7, fanout=2)
    survivors = [v for v in votes if v.index != victim]
    try:
        if when == "before the vote":
            votes[victim].shut_down()
        else:
            threading.Timer(0.3, votes[victim].shut_down).start()
        start = time.perf_counter()
        got = _gather_all(survivors, [[float(v.index)] for v in survivors])
        assert time.perf_counter() - start < 5.0, where
        for vote, result in zip(survivors, got, strict=True):
            assert isinstance(result, ConnectionError), (vote.index, result)
            assert is_comm_error(result)
            assert f"index {victim}" in str(result), (vote.index, result)
        with pytest.raises(ConnectionError, match="failed earlier") as info:
            survivors[0].allgather([0.0], SHORT)
        assert is_comm_error(info.value)
    finally:
        for v in votes:
            v.shut_down()


def test_a_worker_that_has_the_table_returns_it_though_a_child_is_gone() -> None:
    """The vote completed (every worker sent its row), so a worker whose child dies after
    reporting still returns the table ([Note: workers decide the commit]); the dead
    child's own children, who never get it, fail."""
    votes, _host = _votes(7, fanout=2)
    try:
        # Worker 2 reports its subtree, then dies; the root sends the table down only
        # once worker 2's exchange has failed.
        original_send, original_table = votes[2]._send, votes[0]._table
        gone = threading.Event()

        def send_then_die(peer: int, message: bytes) -> None:
            original_send(peer, message)
            votes[2].shut_down()

        def table_once_gone(*args: Any) -> bytes:
            assert gone.wait(10)
            return original_table(*args)

        def noted(row: list[float], timeout: datetime.timedelta) -> list[tuple[float, ...]]:
            try:
                return CommitVote.allgather(votes[2], row, timeout)
            finally:
                gone.set()

        votes[2]._send = send_then_die  # type: ignore[method-assign]
        votes[0]._table = table_once_gone  # type: ignore[method-assign]
        votes[2].allgather = noted  # type: ignore[method-assign]
        got = _gather_all(votes, [[float(i)] for i in range(7)])
        table = [(float(i),) for i in range(7)]
        for i in (0, 1, 3, 4):
            assert got[i] == table, (i, got[i])
        for i in (2, 5, 6):
            assert isinstance(got[i], ConnectionError), (i, got[i])
    finally:
        for v in votes:
            v.shut_down()
