"""A generation's workers connected pairwise by plain TCP, for all-gathering a few floats
on the calling thread: the commit vote of every step (`StageComm.exchange`).

[Note: the vote's own connections]
The workers' vote on each step's commit ([Note: workers decide the commit] in
recovery/worker/stage.py) is one all-gather of four floats per worker. Over a Gloo group
it cost the data-parallel 10 MB job of ``bench.py peers`` ~1.9 ms a step (19.2 against
17.3 ms with the vote left out; a worker waited 1.0-1.3 ms in it at the median, and from
the later worker's arrival to the first one's return took 0.37 ms at the median and 3.2
ms at the 90th percentile): Gloo runs a collective on a
worker thread of its own and its bytes arrive through a third, so a few bytes cross
several sleeping threads on each side, and on a two-core VM each wake-up can wait for a
core. Here the calling thread writes its row to each peer's socket and reads theirs;
nothing else is woken. ``python scripts/engine_vs_ddp.py`` (the same workload, no
runtime) puts the two side by side against DDP (docs/bench/engine_vs_ddp.txt, three
rounds): 16.1-16.8 ms a step with the vote on these sockets, 18.1-18.4 ms with it over
Gloo, 16.8-17.9 ms for DDP, 15.9-16.4 ms without a vote.

The semantics are the all-gather's: every worker sends its row to every other and
returns once it holds all of them, so a complete result anywhere means every worker
sent its row -- every worker reached the vote. A peer that dies closes its sockets and
the survivors' reads fail at once ("connection closed"); `Mesh.shut_down` (the
worker's own teardown, from any thread) wakes a reader here and fails the peers' reads
of this worker, as cutting the Gloo connections does ([Note: tearing down on failure]
in parallelism/comm.py). Each message carries the exchange's number, so two workers
out of step fail loudly instead of pairing the wrong rows.

A full mesh is ``n - 1`` sockets a worker: fine for the jobs this runs (tens of
workers); a much larger job would want a tree.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["Mesh"]

_TOKEN_BYTES = 16
_HELLO = struct.Struct(f"<I{_TOKEN_BYTES}s")
"""What a connecting worker sends first: its index and the token the listener published."""
_ACK = struct.Struct("<I")
"""The listener's answer to a hello it takes: its own index."""
_HEADER = struct.Struct("<QI")
"""A row's header: the exchange's number and the row's length (float64s follow)."""
_MAX_ROW = 1 << 16
_POLL_S = 0.05
"""How often a formation waiting on a peer looks at ``cancel`` and its deadline."""
_HELLO_S = 2.0
"""How long an accepted connection has to say which peer it is."""


class Mesh:
    """One worker's TCP connections to every other worker of its generation.

    Args:
        store: the generation's store (each worker publishes its listening address there).
        index: this worker's index in the generation, ``0 <= index < size``.
        size: the generation's number of workers.
        bind_host: the address to listen on (this worker's node's IP).
        timeout: how long forming the mesh may take.
        cancel: set from another thread to give up forming at once.

    Raises:
        ConnectionError: if a peer does not connect within ``timeout``, or ``cancel`` is
            set meanwhile (a communication error: a peer died or the generation was given up).
    """

    def __init__(
        self,
        store: dist.Store,
        index: int,
        size: int,
        bind_host: str,
        timeout: datetime.timedelta,
        cancel: threading.Event | None = None,
    ) -> None:
        if not 0 <= index < size:
            raise ValueError(f"index {index} is not in a generation of {size}")
        self.index = index
        self.size = size
        self._count = 0
        self._peers: dict[int, socket.socket] = {}
        self._cut = False
        deadline = time.monotonic() + timeout.total_seconds()
        cancel = cancel or threading.Event()
        listener = socket.create_server((bind_host, 0), backlog=max(1, size))
        try:
            host, port = listener.getsockname()[:2]
            token = secrets.token_bytes(_TOKEN_BYTES)
            store.set(f"mesh/{index}", f"{host} {port} {token.hex()}")
            # Connect to every lower index, then accept every higher one: lower indices
            # answer first, so no order can deadlock. A connection says whom it is from
            # and names the listener's token, and the listener answers with its index:
            # a stale worker of another generation that reaches a reused port, or a
            # stranger, is turned away instead of being taken for a peer.
            for peer in range(index):
                host, port, theirs = self._address(store, peer, deadline, cancel)
                sock = socket.create_connection((host, int(port)), timeout=_HELLO_S)
                try:
                    sock.sendall(_HELLO.pack(index, bytes.fromhex(theirs)))
                    (answer,) = _ACK.unpack(_recv_exactly(sock, _ACK.size, deadline, cancel))
                except BaseException:
                    sock.close()
                    raise
                if answer != peer:
                    sock.close()
                    raise ConnectionError(
                        f"vote mesh: index {peer}'s address answered as index {answer}"
                    )
                self._add(peer, sock)
            listener.settimeout(_POLL_S)
            while len(self._peers) < size - 1:
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    self._check(deadline, cancel, "a peer to connect")
                    continue
                hello_by = min(deadline, time.monotonic() + _HELLO_S)
                try:
                    peer, named = _HELLO.unpack(_recv_exactly(sock, _HELLO.size, hello_by, cancel))
                    known = index < peer < size and peer not in self._peers and named == token
                    if known:
                        sock.sendall(_ACK.pack(index))
                except OSError:  # not one of ours (ConnectionError and timeouts included)
                    known = False
                if not known:
                    sock.close()  # a stranger: ignored, the peers still come
                    continue
                self._add(peer, sock)
        except BaseException:
            self.shut_down()
            raise
        finally:
            listener.close()

    def allgather(
        self, row: Sequence[float], timeout: datetime.timedelta
    ) -> list[tuple[float, ...]]:
        """Every worker's ``row`` (all of one length), by index; blocks. One thread at a
        time (the step's): the rows of two exchanges at once would interleave.

        Raises:
            ConnectionError: a peer died or this mesh was shut down, the rows did not all
                arrive within ``timeout``, or a peer sent a row that is not this
                exchange's (a communication error, in every case).
        """
        if len(row) > _MAX_ROW:
            raise ValueError(f"a row of {len(row)} floats is longer than {_MAX_ROW}")
        number = self._count
        self._count += 1
        message = _HEADER.pack(number, len(row)) + struct.pack(f"<{len(row)}d", *row)
        rows: list[tuple[float, ...] | None] = [None] * self.size
        rows[self.index] = tuple(float(x) for x in row)
        want = len(message)
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout.total_seconds()
        with selectors.DefaultSelector() as selector:
            if self._cut:
                raise ConnectionError("vote mesh: connection closed (this worker was torn down)")
            for peer, sock in self._peers.items():
                try:
                    sock.sendall(message)
                except OSError as exc:
                    raise self._lost(peer, exc) from exc
                selector.register(sock, selectors.EVENT_READ, peer)
                got[peer] = b""
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(p for p, b in got.items() if len(b) < want)
                    raise ConnectionError(
                        f"vote mesh: timed out after {timeout.total_seconds():.1f} s "
                        f"waiting for the rows of indices {missing}"
                    )
                for key, _ in selector.select(left):
                    peer = key.data
                    try:
                        chunk = key.fileobj.recv(want - len(got[peer]))  # type: ignore[union-attr]
                    except OSError as exc:
                        raise self._lost(peer, exc) from exc
                    if not chunk:
                        raise self._lost(peer, None)
                    before, got[peer] = len(got[peer]), got[peer] + chunk
                    if before < _HEADER.size <= len(got[peer]):
                        self._check_header(peer, got[peer], number, len(row))
                    if len(got[peer]) == want:
                        selector.unregister(key.fileobj)
                        rows[peer] = struct.unpack_from(f"<{len(row)}d", got[peer], _HEADER.size)
        return rows  # type: ignore[return-value]

    def shut_down(self) -> None:
        """Cut every connection (from any thread): a read waiting here wakes and fails, and
        so do the peers' reads of this worker. Safe to call more than once."""
        self._cut = True
        for sock in list(self._peers.values()):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # -- helpers ---------------------------------------------------------------------------

    def _add(self, peer: int, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[peer] = sock

    def _lost(self, peer: int, exc: OSError | None) -> ConnectionError:
        why = "this worker's groups were torn down" if self._cut else f"{exc or 'end of stream'}"
        return ConnectionError(f"vote mesh: connection to index {peer} closed ({why})")

    @staticmethod
    def _check_header(peer: int, data: bytes, number: int, length: int) -> None:
        their_number, their_length = _HEADER.unpack_from(data)
        if their_number != number or their_length != length:
            raise ConnectionError(
                f"vote mesh: index {peer} sent exchange {their_number} of {their_length} "
                f"floats, expected exchange {number} of {length} (a garbled connection)"
            )

    @staticmethod
    def _address(
        store: dist.Store, peer: int, deadline: float, cancel: threading.Event
    ) -> tuple[str, str, str]:
        """``peer``'s host, port and token (hex), once it published them."""
        key = f"mesh/{peer}"
        while not store.check([key]):
            Mesh._check(deadline, cancel, f"index {peer} to publish its address")
            time.sleep(0.001)
        host, port, token = store.get(key).decode().split()
        return host, port, token

    @staticmethod
    def _check(deadline: float, cancel: threading.Event, what: str) -> None:
        if cancel.is_set():
            raise ConnectionError(f"vote mesh: formation abandoned while waiting for {what}")
        if time.monotonic() > deadline:
            raise ConnectionError(f"vote mesh: timed out waiting for {what}")


def _recv_exactly(sock: socket.socket, n: int, deadline: float, cancel: threading.Event) -> bytes:
    """``n`` bytes of the handshake, read by ``deadline`` unless ``cancel`` is set."""
    sock.settimeout(_POLL_S)
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            Mesh._check(deadline, cancel, "a peer's handshake")
            continue
        if not chunk:
            raise ConnectionError("vote mesh: connection closed during the handshake")
        data += chunk
    return data
