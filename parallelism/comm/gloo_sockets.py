"""The TCP connections under a worker's Gloo groups, found when the groups form and cut
when they are torn down (`StageComm.close`), since nothing in Gloo cuts them.

[Note: tearing down on failure]
Gloo wakes a survivor blocked on a dead peer within a fraction of a second ("Connection
closed by peer"), but it does not wake a survivor blocked on a *live* peer that has given
up, and neither ``abort()`` nor ``shutdown()`` of a Gloo group wakes anything: they do not
close its sockets while an operation is pending (measured on torch 2.13). So `StageComm.close`
shuts down the group's TCP connections itself (`_Transport`): every operation of this
worker fails at once, whichever thread waits on it, and every peer waiting on this worker
sees the connection close and fails too. A worker that sees a communication error closes
at once, and the controller tells all others to close as soon as one fails, so every
survivor leaves the failed step within milliseconds of the first error instead of when the
failure reaches it through the schedule. Timeouts (``timeout``) remain the backstop for
hangs, which the controller handles by killing the hung worker. NCCL needs none of this:
``ProcessGroupNCCL.abort()`` aborts its communicators (all of a worker's at once, see
[Note: NCCL groups that abort] in parallelism/comm/groups.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import torch.distributed as dist


def _socket_inodes() -> dict[int, str]:
    """This process's open sockets: fd -> ``socket:[inode]`` (empty where /proc is missing)."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                out[int(fd)] = target
    return out


@contextlib.contextmanager
def _held_socket(fd: int, target: str) -> Iterator[socket.socket | None]:
    """The socket ``fd`` named when it was listed as ``target``, held by a duplicate; or None.

    Between listing /proc/self/fd and using an fd, another thread may close it and reuse
    the number for a new socket (a store client, the next generation's Gloo pair). The
    duplicate keeps whatever the fd names *now* open, and its inode says whether that is
    still the listed socket, so nothing else is ever touched.
    """
    sock: socket.socket | None = None
    with contextlib.suppress(OSError):
        dup = os.dup(fd)
        try:
            if f"socket:[{os.fstat(dup).st_ino}]" == target:
                sock = socket.socket(fileno=dup)
        finally:
            if sock is None:
                os.close(dup)
    if sock is None:
        yield None
        return
    with sock:
        yield sock


class _Transport:
    """The TCP connections of one worker's Gloo groups, so that `close` can cut them.

    See [Note: tearing down on failure]. The sockets are those that appeared while the
    groups formed (``before`` is the snapshot taken just ahead) *and* that belong to a Gloo
    pair: accepted on one of this worker's Gloo listeners, or connected to a peer's. Every
    worker publishes its listener ports in the generation's store, so a socket some other
    thread of the process opened meanwhile (Ray's) is never touched.
    """

    def __init__(
        self, before: dict[int, str], store: dist.Store, rank: int, peers: list[int]
    ) -> None:
        new = {fd: ino for fd, ino in _socket_inodes().items() if before.get(fd) != ino}
        listening: set[int] = set()
        connected: dict[int, tuple[str, int, int]] = {}  # fd -> (inode, local port, remote port)
        for fd, inode in new.items():
            with contextlib.suppress(OSError), _held_socket(fd, inode) as sock:
                if sock is None:
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    listening.add(sock.getsockname()[1])
                elif sock.type == socket.SOCK_STREAM:
                    connected[fd] = (inode, sock.getsockname()[1], sock.getpeername()[1])
        store.set(f"gloo_ports/{rank}", ",".join(str(p) for p in sorted(listening)))
        ports = set(listening)
        for peer in peers:
            text = store.get(f"gloo_ports/{peer}").decode()
            ports |= {int(p) for p in text.split(",") if p}
        self._sockets = {
            fd: inode
            for fd, (inode, local, remote) in connected.items()
            if local in listening or remote in ports
        }

    def shut_down(self) -> None:
        """Shut every Gloo connection down, waking all waiters here and at the peers."""
        for fd, inode in self._sockets.items():
            # Closed already, the fd may now name something else: only the listed socket.
            with contextlib.suppress(OSError), _held_socket(fd, inode) as sock:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
        self._sockets = {}
