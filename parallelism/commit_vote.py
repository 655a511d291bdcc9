"""The commit vote of every step: a generation's workers all-gather a few floats each,
over plain TCP connections laid out as a tree, on the calling thread (`StageComm.exchange`).

[Note: the vote's own connections]
The workers' vote on each step's commit ([Note: workers decide the commit] in
recovery/worker/stage.py) is one all-gather of four floats per worker. Over a Gloo group
it cost the data-parallel 10 MB job of ``bench.py peers`` ~1.9 ms a step (19.2 against
17.3 ms with the vote left out; a worker waited 1.0-1.3 ms in it at the median, and from
the later worker's arrival to the first one's return took 0.37 ms at the median and 3.2
ms at the 90th percentile): Gloo runs a collective on a worker thread of its own and its
bytes arrive through a third, so a few bytes cross several sleeping threads on each side,
and on a two-core VM each wake-up can wait for a core. Here the calling thread writes to
and reads from sockets of its own; nothing else is woken. ``python
scripts/engine_vs_ddp.py`` (the same workload, no runtime) puts the two side by side
against DDP (docs/bench/engine_vs_ddp.txt, three rounds, when the vote was a full mesh):
16.1-16.8 ms a step with the vote on these sockets, 18.1-18.4 ms with it over Gloo,
16.8-17.9 ms for DDP, 15.9-16.4 ms without a vote.

The connections form a tree ("heap" order, ``FANOUT`` children a worker): index 0 is the
root, the parent of ``i`` is ``(i - 1) // FANOUT``. Each worker sends its subtree's rows to
its parent once all its children sent theirs; the root, holding every row, sends the whole
table down, and each worker passes it on to its children. The callers use every row
(`StepReport.votes` keeps every worker's loss and norm, so a step's record is whole even
if a worker dies applying it), so the table goes down whole, ``8 * width * n`` bytes.

The semantics are the all-gather's: a complete result anywhere means the root held every
worker's row -- every worker reached the vote. A peer that dies closes its sockets: its
neighbours' reads fail at once ("connection closed"), and a worker whose exchange fails
sends the reason to its other neighbours (a ``FAIL`` message) and shuts its own
connections down, so the failure reaches every worker waiting on it, transitively, up and
down the tree, within a few hops instead of at the timeout. A worker that has the table
passes it on to every child it can, and returns it even if one child is gone (every
worker did reach the vote). `CommitVote.shut_down` (the worker's own teardown, from any
thread) wakes a reader here and fails the neighbours' reads of this worker, as cutting
the Gloo connections does ([Note: tearing down on failure] in
parallelism/comm/gloo_sockets.py). Each message carries the exchange's number, so two
workers out of step fail loudly instead of pairing the wrong rows; once an exchange has
failed, the vote stays failed (the generation is over).

What it costs: ``n - 1`` connections in all, at most ``FANOUT + 1`` a worker (a full mesh
was ``n (n - 1) / 2`` in all, ``n - 1`` a worker: 134 million at 16,384 workers). An
exchange is ``2 * depth`` hops, ``depth = O(log n)`` (1 up to 17 workers, 2 up to 273, 4 at
16,384), each hop a read and a write of one worker; the root reads ``FANOUT`` messages and
writes ``FANOUT`` tables. Measured against the mesh and modelled to 16,384 workers in
docs/DESIGN.md ("The control plane at scale"; ``python scripts/bench.py vote``). A
reduction (all ready, the loss sum and count, one norm per stage) would send ``O(stages)``
bytes down instead of the table, but changes `StepReport.votes` and the loss's summation
order.

[Note: the vote's handshake]
The store is not authenticated -- whoever reaches its port reads and writes it -- so a
parent publishes its address there and nothing else, and the two ends of a connection
prove to each other that they hold the generation's *secret*, which the controller hands
every worker through Ray with the rendezvous (`parallelism.comm.Rendezvous.secret`),
never through the store. A child connects and says ``(its index, a fresh nonce)``; the
parent answers ``(its index, a fresh nonce, its proof)``; the child checks that proof and
answers with its own; the parent checks it and acknowledges (one byte). A proof is
HMAC-SHA256 over the secret of ``"checkfree-vote parent"`` or ``"checkfree-vote child"``,
both indices and both nonces: fresh nonces on both sides make a recorded proof useless
on another connection, the role in it makes the parent's useless as a child's, and the
indices make it useless for another pair. Proofs are compared with
``hmac.compare_digest``. A stranger, or a stale worker of another generation whose
peer's port the listener reused, is turned away; a child that finds a parent unable to
prove itself (an address written into the store by someone else) gives up formation
with a communication error.

A parent takes its children's connections on one thread but not one after another: it
accepts whatever arrives and reads every pending handshake as its bytes come (a
selector), each with a deadline of `_HELLO_S` from its accept, at most `_MAX_PENDING` of
them at once (a newer connection drops the oldest). A stranger that connects and stays
silent therefore delays nobody, and a flood of them neither grows without bound nor
keeps a child out.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from parallelism.errors import CommError

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["FANOUT", "CommitVote", "tree_depth"]

FANOUT = 16
"""Children a worker has at most: the tree's fan-out."""

_NONCE_BYTES = 16
_PROOF = struct.Struct("<32s")
"""A proof of the secret: an HMAC-SHA256 (see [Note: the vote's handshake])."""
_HELLO = struct.Struct(f"<I{_NONCE_BYTES}s")
"""What a connecting child sends first: its index and its nonce."""
_CHALLENGE = struct.Struct(f"<I{_NONCE_BYTES}s32s")
"""The parent's answer to a hello: its own index, its nonce and its proof."""
_ACK = b"\x01"
"""The parent's last word to a child whose proof it took."""
_MIN_SECRET = 16
"""The fewest bytes a generation's secret may have."""
_HEADER = struct.Struct("<QBII")
"""A message's header: the exchange's number, its kind, then for ``_UP`` and ``_DOWN`` the
row's width and the number of rows, for ``_FAIL`` the index that saw the failure and the
length of its reason (UTF-8). ``_UP``: the rows' indices (uint32), then their float64s;
``_DOWN``: every row's float64s, by index."""
_UP, _DOWN, _FAIL = 1, 2, 3
_MAX_ROW = 1 << 16
_MAX_REASON = 4096
_POLL_S = 0.05
"""How often a formation waiting on a peer looks at ``cancel`` and its deadline."""
_HELLO_S = 2.0
"""How long an accepted connection has to complete its handshake."""
_MAX_PENDING = 4 * FANOUT
"""Handshakes a parent reads at once (a newer connection drops the oldest)."""


def tree_depth(size: int, fanout: int = FANOUT) -> int:
    """The depth of the vote's tree over ``size`` workers (0 for one worker): an exchange
    is twice as many hops."""
    depth, level, covered = 0, 1, 1
    while covered < size:
        level *= fanout
        covered += level
        depth += 1
    return depth


def _body_size(kind: int, rows: int, width: int) -> int:
    """Bytes after the header of an ``_UP`` or ``_DOWN`` message of ``rows`` rows."""
    return rows * width * 8 + (rows * 4 if kind == _UP else 0)


def _subtree_size(index: int, size: int, fanout: int) -> int:
    """Workers in ``index``'s subtree, itself included (in heap order, each level of a
    subtree is one run of indices)."""
    count, lo, hi = 0, index, index
    while lo < size:
        count += min(hi, size - 1) - lo + 1
        lo, hi = lo * fanout + 1, hi * fanout + fanout
    return count


class _Relayed(CommError):
    """A neighbour's ``FAIL``: the failure it saw or was told of."""

    def __init__(self, origin: int, reason: str, via: int) -> None:
        super().__init__(f"{reason} (seen by index {origin}, passed on by index {via})")
        self.origin = origin
        self.reason = reason


class CommitVote:
    """One worker's connections to its parent and children in its generation's vote tree.

    Args:
        store: the generation's store (a worker with children publishes its address there).
        secret: the generation's secret, the same for every worker of it, handed to each
            by the controller and never through the store (see [Note: the vote's
            handshake]); at least 16 bytes.
        index: this worker's index in the generation, ``0 <= index < size``.
        size: the generation's number of workers.
        bind_host: the address to listen on (this worker's node's IP).
        timeout: how long forming the tree may take.
        cancel: set from another thread to give up forming at once.
        fanout: children a worker has at most (every worker of a generation must agree).

    Raises:
        ValueError: if ``index`` is outside the generation, ``fanout`` is below 1 or the
            secret is shorter than 16 bytes.
        CommError: if a peer does not connect within ``timeout``, the parent cannot
            prove it holds the secret, or ``cancel`` is set meanwhile (a communication
            error: a peer died or the generation was given up).
    """

    def __init__(
        self,
        store: dist.Store,
        index: int,
        size: int,
        bind_host: str,
        timeout: datetime.timedelta,
        cancel: threading.Event | None = None,
        *,
        secret: bytes,
        fanout: int = FANOUT,
    ) -> None:
        if not 0 <= index < size:
            raise ValueError(f"index {index} is not in a generation of {size}")
        if fanout < 1:
            raise ValueError(f"fanout must be at least 1, got {fanout}")
        if len(secret) < _MIN_SECRET:
            raise ValueError(f"a vote's secret has at least {_MIN_SECRET} bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self.index = index
        self.size = size
        self.parent = (index - 1) // fanout if index else None
        self.children = tuple(range(index * fanout + 1, min(index * fanout + fanout, size - 1) + 1))
        self._subtree = {c: _subtree_size(c, size, fanout) for c in self.children}
        self._count = 0
        self._peers: dict[int, socket.socket] = {}
        self._selector = selectors.DefaultSelector()
        self._registered: set[int] = set()
        self._cut = False
        self._broken: str | None = None
        deadline = time.monotonic() + timeout.total_seconds()
        cancel = cancel or threading.Event()
        try:
            self._form(store, bind_host, deadline, cancel)
        except BaseException:
            self.shut_down()
            raise

    @property
    def connections(self) -> int:
        """This worker's vote connections: to its parent and its children."""
        return len(self._peers)

    def allgather(
        self, row: Sequence[float], timeout: datetime.timedelta
    ) -> list[tuple[float, ...]]:
        """Every worker's ``row`` (all of one width), by index; blocks. One thread at a
        time (the step's): the rows of two exchanges at once would interleave.

        Raises:
            ValueError: if ``row`` is longer than 65,536 floats.
            CommError: a peer died or this vote was shut down, the table did not
                arrive within ``timeout``, a peer sent a message that is not this
                exchange's, or an earlier exchange failed (a communication error, in
                every case). See [Note: the vote's own connections].
        """
        if len(row) > _MAX_ROW:
            raise ValueError(f"a row of {len(row)} floats is longer than {_MAX_ROW}")
        if self._cut:
            raise CommError("commit vote: connection closed (this worker was torn down)")
        if self._broken is not None:
            raise CommError(f"commit vote: connection failed earlier ({self._broken})")
        number, width = self._count, len(row)
        self._count += 1
        mine = struct.pack(f"<{width}d", *row)
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            expect = {c: (_UP, self._subtree[c]) for c in self.children}
            ups = self._receive(expect, number, width, deadline, timeout, guard=self.parent)
            if self.parent is None:
                table = self._table(ups, mine, width)
            else:
                self._send(self.parent, self._up(number, width, mine, ups))
                down = {self.parent: (_DOWN, self.size)}
                table = self._receive(down, number, width, deadline, timeout)[self.parent]
        except ConnectionError as exc:
            self._fail(exc)
            raise
        message = _HEADER.pack(number, _DOWN, width, self.size) + table
        for child in self.children:  # every child that can still take it
            with contextlib.suppress(OSError):
                self._peers[child].sendall(message)
        values = struct.unpack(f"<{self.size * width}d", table)
        return [values[i * width : (i + 1) * width] for i in range(self.size)]

    def shut_down(self) -> None:
        """Cut every connection (from any thread): a read waiting here wakes and fails, and
        so do the neighbours' reads of this worker. Safe to call more than once."""
        self._cut = True
        for sock in list(self._peers.values()):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # -- one exchange ----------------------------------------------------------------------

    def _receive(
        self,
        expect: dict[int, tuple[int, int]],
        number: int,
        width: int,
        deadline: float,
        timeout: datetime.timedelta,
        guard: int | None = None,
    ) -> dict[int, bytes]:
        """One message's body from each neighbour in ``expect`` (its kind and row count),
        watching ``guard`` (the parent, while the children report) for a failure."""
        if not expect:
            return {}
        watched = {*expect, *([guard] if guard is not None else [])}
        self._watch(watched)
        bodies: dict[int, bytes] = {}
        data = {peer: bytearray() for peer in watched}
        # One read takes a whole message: its length is known from what is expected,
        # unless it is a FAIL (its header says how long it is).
        need = {peer: _HEADER.size + _body_size(*expect[peer], width) for peer in expect}
        need.update({guard: _HEADER.size} if guard is not None else {})
        kinds: dict[int, tuple[int, int, int]] = {}
        # A message begun by ``guard`` is a failure (or garbage): read to its end.
        while len(bodies) < len(expect) or (guard is not None and data[guard]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(timeout, sorted(set(expect) - set(bodies)))
            for key, _ in self._selector.select(left):
                peer = key.data
                try:
                    chunk = self._peers[peer].recv(need[peer] - len(data[peer]))
                except OSError as exc:
                    raise self._lost(peer, exc) from exc
                if not chunk:
                    raise self._lost(peer, None)
                data[peer] += chunk
                if peer not in kinds and len(data[peer]) >= _HEADER.size:
                    header = data[peer][: _HEADER.size]
                    kinds[peer] = self._check(peer, header, expect, number, width)
                    need[peer] = _HEADER.size + kinds[peer][1]
                if peer in kinds and len(data[peer]) >= need[peer]:
                    kind, _, count = kinds[peer]
                    body = bytes(data[peer][_HEADER.size : need[peer]])
                    if kind == _FAIL:
                        raise _Relayed(count, body.decode("utf-8", "replace"), peer)
                    bodies[peer] = body
                    self._selector.unregister(key.fileobj)
                    self._registered.discard(peer)
        return bodies

    def _watch(self, peers: set[int]) -> None:
        """Have the selector watch exactly ``peers`` (a leaf's parent stays registered from
        one exchange to the next: no system call to set it up again)."""
        for peer in self._registered - peers:
            self._selector.unregister(self._peers[peer])
        for peer in peers - self._registered:
            self._selector.register(self._peers[peer], selectors.EVENT_READ, peer)
        self._registered = set(peers)

    def _check(
        self,
        peer: int,
        header: bytearray,
        expect: dict[int, tuple[int, int]],
        number: int,
        width: int,
    ) -> tuple[int, int, int]:
        """(kind, body bytes, rows or origin) of a header from ``peer``.

        Raises:
            CommError: if it is not the message this exchange expects from ``peer``.
        """
        their_number, kind, a, b = _HEADER.unpack(header)
        if kind == _FAIL and 0 <= a < self.size and b <= _MAX_REASON:
            return kind, b, a  # a failure, whichever exchange it was seen in
        if peer not in expect:
            raise CommError(
                f"commit vote: index {peer} sent a message (kind {kind}, exchange "
                f"{their_number}) while none was due from it (a garbled connection)"
            )
        want_kind, rows = expect[peer]
        if (their_number, kind, a, b) != (number, want_kind, width, rows):
            raise CommError(
                f"commit vote: index {peer} sent message {kind} of exchange {their_number} "
                f"({b} rows of {a} floats), expected exchange {number} of {rows} rows of "
                f"{width} floats (a garbled connection)"
            )
        return kind, _body_size(kind, b, a), b

    def _up(self, number: int, width: int, mine: bytes, ups: dict[int, bytes]) -> bytes:
        """The message to the parent: this subtree's indices, then its rows."""
        parts = [ups[c] for c in self.children]
        counts = [self._subtree[c] for c in self.children]
        indices = [struct.pack("<I", self.index)]
        rows = [mine]
        for body, count in zip(parts, counts, strict=True):
            indices.append(body[: 4 * count])
            rows.append(body[4 * count :])
        total = 1 + sum(counts)
        return _HEADER.pack(number, _UP, width, total) + b"".join(indices) + b"".join(rows)

    def _table(self, ups: dict[int, bytes], mine: bytes, width: int) -> bytes:
        """The root's table: every row, by index.

        Raises:
            CommError: if the children's indices are not every other worker's once.
        """
        rows: list[bytes | None] = [None] * self.size
        rows[self.index] = mine
        step = 8 * width
        for child in self.children:
            body, count = ups[child], self._subtree[child]
            for k, i in enumerate(struct.unpack_from(f"<{count}I", body)):
                if not 0 <= i < self.size or rows[i] is not None:
                    raise CommError(
                        f"commit vote: index {child} sent a row for index {i} "
                        "(out of range or twice: a garbled connection)"
                    )
                start = 4 * count + k * step
                rows[i] = body[start : start + step]
        return b"".join(r for r in rows if r is not None)

    def _send(self, peer: int, message: bytes) -> None:
        try:
            self._peers[peer].sendall(message)
        except OSError as exc:
            raise self._lost(peer, exc) from exc

    def _fail(self, exc: ConnectionError) -> None:
        """Pass a failed exchange's reason on to every neighbour, then cut the connections:
        nobody waits on this worker for the timeout (see [Note: the vote's own connections])."""
        if self._cut:
            return
        if isinstance(exc, _Relayed):
            origin, reason = exc.origin, exc.reason
        else:
            origin, reason = self.index, str(exc)
        self._broken = str(exc)
        encoded = reason.encode()[:_MAX_REASON]
        message = _HEADER.pack(self._count - 1, _FAIL, origin, len(encoded)) + encoded
        for sock in self._peers.values():
            with contextlib.suppress(OSError):
                sock.send(message, socket.MSG_DONTWAIT)
        for sock in self._peers.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _lost(self, peer: int, exc: OSError | None) -> CommError:
        why = "this worker was torn down" if self._cut else f"{exc or 'end of stream'}"
        return CommError(f"commit vote: connection to index {peer} closed ({why})")

    def _timed_out(self, timeout: datetime.timedelta, missing: list[int]) -> CommError:
        if missing == [self.parent]:
            what = f"the table from index {self.parent}"
        else:
            what = f"the rows of indices {missing} (each with its subtree's)"
        return CommError(
            f"commit vote: timed out after {timeout.total_seconds():.1f} s waiting for {what}"
        )

    # -- formation -------------------------------------------------------------------------

    def _form(
        self, store: dist.Store, bind_host: str, deadline: float, cancel: threading.Event
    ) -> None:
        """Connect to the parent, then accept the children; each connection proves both
        ends hold the generation's secret (see [Note: the vote's handshake])."""
        listener = None
        if self.children:
            listener = socket.create_server((bind_host, 0), backlog=64)
        try:
            if listener is not None:
                host, port = listener.getsockname()[:2]
                store.set(f"vote/{self.index}", f"{host} {port}")
            if self.parent is not None:
                self._connect(store, self.parent, deadline, cancel)
            if listener is not None:
                self._accept(listener, deadline, cancel)
        finally:
            if listener is not None:
                listener.close()

    def _proof(self, role: bytes, parent: int, child: int, nonces: bytes) -> bytes:
        """The ``role``'s proof for the connection of ``parent`` and ``child``."""
        message = b"checkfree-vote " + role + struct.pack("<II", parent, child) + nonces
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def _connect(
        self, store: dist.Store, parent: int, deadline: float, cancel: threading.Event
    ) -> None:
        key = f"vote/{parent}"
        while not store.check([key]):
            _check(deadline, cancel, f"index {parent} to publish its address")
            time.sleep(0.001)
        host, port = store.get(key).decode().split()[:2]
        sock = socket.create_connection((host, int(port)), timeout=_HELLO_S)
        try:
            ours = secrets.token_bytes(_NONCE_BYTES)
            sock.sendall(_HELLO.pack(self.index, ours))
            challenge = _recv_exactly(sock, _CHALLENGE.size, deadline, cancel)
            answer, theirs, proof = _CHALLENGE.unpack(challenge)
            if answer != parent:
                raise CommError(f"commit vote: index {parent}'s address answered as index {answer}")
            nonces = ours + theirs
            if not hmac.compare_digest(proof, self._proof(b"parent", parent, self.index, nonces)):
                raise CommError(
                    f"commit vote: index {parent}'s address did not prove it holds this "
                    "generation's secret (a stranger, or a worker of another generation)"
                )
            sock.sendall(_PROOF.pack(self._proof(b"child", parent, self.index, nonces)))
            if _recv_exactly(sock, len(_ACK), deadline, cancel) != _ACK:
                raise CommError(f"commit vote: index {parent} did not take this worker")
        except BaseException:
            sock.close()
            raise
        self._add(parent, sock)

    def _accept(self, listener: socket.socket, deadline: float, cancel: threading.Event) -> None:
        """Take every child's connection, reading the pending handshakes together (see
        [Note: the vote's handshake])."""
        listener.setblocking(False)
        pending: dict[socket.socket, _Handshake] = {}  # oldest first
        waiting = selectors.DefaultSelector()
        waiting.register(listener, selectors.EVENT_READ, None)

        def drop(sock: socket.socket) -> None:
            pending.pop(sock, None)
            with contextlib.suppress(KeyError, ValueError):
                waiting.unregister(sock)
            sock.close()

        try:
            while any(c not in self._peers for c in self.children):
                _check(deadline, cancel, "a child to connect")
                now = time.monotonic()
                for sock in [s for s, h in pending.items() if h.by <= now]:
                    drop(sock)  # too slow to say who it is: a stranger, ignored
                soonest = min([h.by for h in pending.values()], default=now + _POLL_S)
                for key, _ in waiting.select(max(0.0, min(soonest - now, _POLL_S))):
                    if key.data is None:
                        self._take_new(listener, pending, waiting, drop, deadline)
                        continue
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    child = self._step(conn, key.data)
                    if child is None:
                        continue
                    pending.pop(conn)
                    waiting.unregister(conn)
                    if child < 0:
                        conn.close()  # not one of ours: ignored, the children still come
                    else:
                        self._add(child, conn)
        finally:
            for sock in list(pending):
                drop(sock)
            waiting.close()

    def _take_new(
        self,
        listener: socket.socket,
        pending: dict[socket.socket, _Handshake],
        waiting: selectors.BaseSelector,
        drop: Callable[[socket.socket], None],
        deadline: float,
    ) -> None:
        """Accept every connection waiting on ``listener``, dropping the oldest pending
        handshakes beyond `_MAX_PENDING`."""
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            while len(pending) >= _MAX_PENDING:
                drop(next(iter(pending)))
            by = min(deadline, time.monotonic() + _HELLO_S)
            pending[sock] = handshake = _Handshake(by)
            waiting.register(sock, selectors.EVENT_READ, handshake)

    def _step(self, sock: socket.socket, handshake: _Handshake) -> int | None:
        """Read what ``sock`` sent of its handshake and answer it when whole. Returns the
        child it proved to be, -1 if it is turned away, None while it is not done."""
        try:
            chunk = sock.recv(handshake.need - len(handshake.data))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return -1
        if not chunk:
            return -1
        handshake.data += chunk
        if len(handshake.data) < handshake.need:
            return None
        data, handshake.data = handshake.data, b""
        try:
            if handshake.child is None:  # its hello: answer with the challenge
                child, theirs = _HELLO.unpack(data)
                if child not in self.children or child in self._peers:
                    return -1
                ours = secrets.token_bytes(_NONCE_BYTES)
                handshake.child, handshake.nonces = child, theirs + ours
                proof = self._proof(b"parent", self.index, child, handshake.nonces)
                _send_all_now(sock, _CHALLENGE.pack(self.index, ours, proof))
                handshake.need = _PROOF.size
                return None
            child = handshake.child
            (proof,) = _PROOF.unpack(data)
            expected = self._proof(b"child", self.index, child, handshake.nonces)
            if not hmac.compare_digest(proof, expected) or child in self._peers:
                return -1
            _send_all_now(sock, _ACK)
            return child
        except OSError:
            return -1

    def _add(self, peer: int, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[peer] = sock


class _Handshake:
    """A connection's handshake as its parent reads it (see [Note: the vote's handshake])."""

    def __init__(self, by: float) -> None:
        self.by = by
        """When it must be done (monotonic seconds)."""
        self.need = _HELLO.size
        """Bytes of the message being read."""
        self.data = b""
        self.child: int | None = None
        """The index its hello named, once read."""
        self.nonces = b""


def _send_all_now(sock: socket.socket, data: bytes) -> None:
    """Send a handshake message at once on a non-blocking socket (it is small, and a fresh
    connection's buffer takes it whole).

    Raises:
        OSError: if it could not be sent whole.
    """
    if sock.send(data) != len(data):
        raise CommError("commit vote: a handshake message did not fit the socket")


def _check(deadline: float, cancel: threading.Event, what: str) -> None:
    if cancel.is_set():
        raise CommError(f"commit vote: formation abandoned while waiting for {what}")
    if time.monotonic() > deadline:
        raise CommError(f"commit vote: connection timed out waiting for {what}")


def _recv_exactly(sock: socket.socket, n: int, deadline: float, cancel: threading.Event) -> bytes:
    """``n`` bytes of the handshake, read by ``deadline`` unless ``cancel`` is set."""
    sock.settimeout(_POLL_S)
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            _check(deadline, cancel, "a peer's handshake")
            continue
        if not chunk:
            raise CommError("commit vote: connection closed during the handshake")
        data += chunk
    return data
