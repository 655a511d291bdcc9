"""`CommitVote`: the commit vote's all-gather over a tree of plain TCP connections
([Note: the vote's own connections])."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import math
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from parallelism import commit_vote
from parallelism.comm import host_store
from parallelism.comm.gloo_sockets import _socket_inodes
from parallelism.commit_vote import FANOUT, CommitVote, tree_depth
from recovery.worker.reports import is_comm_error

SHORT = datetime.timedelta(seconds=20)
SECRET = secrets.token_bytes(32)
HELLO_S = 6.0
"""The handshake deadline in the tests that time a formation beside strangers (the
library's is 2 s): a serial wait costs a whole deadline, a loaded machine's pause not."""
"""The generation's secret, as the controller hands it to every worker (through Ray)."""


def _store(host: dist.TCPStore) -> dist.Store:
    client = dist.TCPStore("127.0.0.1", host.port, None, False, SHORT)
    return dist.PrefixStore("gen0", client)


def _votes(size: int, fanout: int = FANOUT) -> tuple[list[CommitVote], dist.TCPStore]:
    host = host_store("127.0.0.1")
    store = _store(host)  # one client for all: a TCPStore client serialises its calls
    with ThreadPoolExecutor(size) as pool:
        futures = [
            pool.submit(
                CommitVote, store, i, size, "127.0.0.1", SHORT, fanout=fanout, secret=SECRET
            )
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
        CommitVote(_store(host), 0, 2, "127.0.0.1", SHORT, cancel, secret=SECRET)
    assert time.perf_counter() - start < 3.0
    assert is_comm_error(info.value)


def test_a_stranger_or_a_stale_peer_connecting_during_formation_is_turned_away() -> None:
    """Something else reaching the listener -- a port scan, or a worker of an earlier
    generation whose peer's port the listener reused, naming the right index but not
    holding this generation's secret -- is dropped and the real peer still joins."""
    host = host_store("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(CommitVote, _store(host), 0, 2, "127.0.0.1", SHORT, secret=SECRET)
        address = _address(host, 0)
        strangers = [socket.create_connection(address) for _ in range(3)]
        strangers[0].sendall(struct.pack("<I", 7))  # a few bytes, then nothing
        strangers[1].sendall(struct.pack("<I16s", 1, b"\0" * 16))  # index 1, then no proof
        strangers[2].sendall(struct.pack("<I16s", 9, b"\0" * 16))  # no index 9
        second = CommitVote(_store(host), 1, 2, "127.0.0.1", SHORT, secret=SECRET)
        vote0 = first.result(timeout=30)
    try:
        for s in strangers:  # never taken: closed, after a challenge at most
            assert len(_until_closed(s)) in (0, _CHALLENGE_BYTES)
        assert _gather_all([vote0, second], [[0.0], [1.0]]) == [[(0.0,), (1.0,)]] * 2
    finally:
        for s in strangers:
            s.close()
        vote0.shut_down()
        second.shut_down()


# -- the handshake: a challenge over the generation's secret (issue 33 item 9) -------------

_CHALLENGE_BYTES = 4 + 16 + 32
"""What a parent answers a hello with: its index, its nonce, its proof."""


def _address(host: dist.TCPStore, index: int) -> tuple[str, int]:
    """Where ``index`` listens, as its store key says (waiting for it)."""
    store = _store(host)
    store.wait([f"vote/{index}"])
    fields = store.get(f"vote/{index}").decode().split()
    return fields[0], int(fields[1])


def _until_closed(sock: socket.socket) -> bytes:
    """Everything ``sock`` receives until its peer closes it (5 s at most)."""
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def _mac(secret: bytes, role: bytes, parent: int, child: int, theirs: bytes, ours: bytes) -> bytes:
    """The handshake's proof as [Note: the vote's handshake] defines it."""
    message = b"checkfree-vote " + role + struct.pack("<II", parent, child) + theirs + ours
    return hmac.new(secret, message, hashlib.sha256).digest()


def _knock(address: tuple[str, int], child: int, secret: bytes) -> bytes:
    """A client that follows the handshake as child ``child`` with ``secret`` (without
    checking the parent's proof): the parent's first byte after the client's proof (its
    acknowledgement), or nothing (turned away: closed)."""
    with socket.create_connection(address, timeout=5) as sock:
        nonce = secrets.token_bytes(16)
        sock.sendall(struct.pack("<I16s", child, nonce))
        got = b""
        while len(got) < _CHALLENGE_BYTES:
            chunk = sock.recv(_CHALLENGE_BYTES - len(got))
            assert chunk, "closed before the challenge"
            got += chunk
        parent, theirs, _ = struct.unpack("<I16s32s", got)
        sock.sendall(_mac(secret, b"child", parent, child, nonce, theirs))
        return sock.recv(1)


def test_the_store_holds_no_secret_and_a_stranger_who_reads_it_cannot_join() -> None:
    """The store is not authenticated: whoever reaches its port reads it. What a parent
    publishes there is its address only, and a client proving itself with anything read
    there is turned away; the real child still joins."""
    host = host_store("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(CommitVote, _store(host), 0, 2, "127.0.0.1", SHORT, secret=SECRET)
        address = _address(host, 0)
        published = _store(host).get("vote/0")
        assert published.decode().split() == [address[0], str(address[1])]
        assert _knock(address, 1, published) == b""
        second = CommitVote(_store(host), 1, 2, "127.0.0.1", SHORT, secret=SECRET)
        vote0 = first.result(timeout=30)
    try:
        assert _gather_all([vote0, second], [[0.0], [1.0]]) == [[(0.0,), (1.0,)]] * 2
    finally:
        vote0.shut_down()
        second.shut_down()


@pytest.mark.parametrize("right", [False, True])
def test_a_wrong_proof_is_refused_and_the_right_one_taken(right: bool) -> None:
    host = host_store("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            CommitVote, _store(host), 0, 2, "127.0.0.1", datetime.timedelta(seconds=3),
            secret=SECRET,
        )  # fmt: skip
        answer = _knock(_address(host, 0), 1, SECRET if right else b"another generation's")
        if right:  # taken as index 1: the formation is complete
            assert answer == b"\x01"
            first.result(timeout=30).shut_down()
        else:  # turned away: index 1 never came
            assert answer == b""
            with pytest.raises(ConnectionError, match="timed out"):
                first.result(timeout=30)


def test_a_parent_that_cannot_prove_itself_is_refused_by_the_child() -> None:
    """The address in the store could be anyone's (the store is writable by whoever
    reaches it): a child checks its parent's proof before it sends its own."""
    host = host_store("127.0.0.1")
    with socket.create_server(("127.0.0.1", 0)) as fake:
        _store(host).set("vote/0", f"127.0.0.1 {fake.getsockname()[1]}")

        def answer_wrongly() -> None:
            sock, _ = fake.accept()
            with sock:
                _, nonce = struct.unpack("<I16s", sock.recv(20))
                ours = secrets.token_bytes(16)
                proof = _mac(b"not the secret", b"parent", 0, 1, nonce, ours)
                sock.sendall(struct.pack("<I16s32s", 0, ours, proof))
                _until_closed(sock)

        threading.Thread(target=answer_wrongly, daemon=True).start()
        with pytest.raises(ConnectionError, match="secret") as info:
            CommitVote(_store(host), 1, 2, "127.0.0.1", SHORT, secret=SECRET)
    assert is_comm_error(info.value)


def test_silent_strangers_do_not_hold_the_formation_up_one_after_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each connection has a short handshake deadline, and several are handled at once:
    five strangers that connect and say nothing used to cost 2 s each, one after the
    other, before the real child was even read."""
    monkeypatch.setattr(commit_vote, "_HELLO_S", HELLO_S)  # room for a loaded machine's pauses
    host = host_store("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(CommitVote, _store(host), 0, 2, "127.0.0.1", SHORT, secret=SECRET)
        address = _address(host, 0)
        strangers = [socket.create_connection(address) for _ in range(5)]
        try:
            time.sleep(0.2)  # accepted before the child comes
            start = time.monotonic()
            second = CommitVote(_store(host), 1, 2, "127.0.0.1", SHORT, secret=SECRET)
            vote0 = first.result(timeout=30)
            took = time.monotonic() - start
        finally:
            for s in strangers:
                s.close()
    vote0.shut_down()
    second.shut_down()
    assert took < HELLO_S - 1.5, took  # under one stranger's handshake deadline


def test_many_strangers_are_capped_and_the_child_still_joins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More strangers than the listener keeps pending: the oldest are dropped, so a flood
    neither grows without bound nor keeps the child out."""
    monkeypatch.setattr(commit_vote, "_MAX_PENDING", 4)
    monkeypatch.setattr(commit_vote, "_HELLO_S", HELLO_S)
    host = host_store("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(CommitVote, _store(host), 0, 2, "127.0.0.1", SHORT, secret=SECRET)
        address = _address(host, 0)
        strangers = [socket.create_connection(address) for _ in range(12)]
        try:
            start = time.monotonic()
            second = CommitVote(_store(host), 1, 2, "127.0.0.1", SHORT, secret=SECRET)
            vote0 = first.result(timeout=30)
            took = time.monotonic() - start
            assert all(_until_closed(s) == b"" for s in strangers)  # none was taken
        finally:
            for s in strangers:
                s.close()
    vote0.shut_down()
    second.shut_down()
    assert took < HELLO_S - 1.5, took  # not kept waiting until the pending ones time out


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
    every connection are here; the listeners are closed once the tree is formed). The new
    sockets, not the count: an earlier test's threads may still be closing theirs."""
    size, fanout = 16, 3
    host = host_store("127.0.0.1")
    store = _store(host)
    before = set(_socket_inodes().values())
    with ThreadPoolExecutor(size) as pool:
        futures = [
            pool.submit(
                CommitVote, store, i, size, "127.0.0.1", SHORT, fanout=fanout, secret=SECRET
            )
            for i in range(size)
        ]
        votes = [f.result(timeout=30) for f in futures]
    try:
        assert len(set(_socket_inodes().values()) - before) == 2 * (size - 1)
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
