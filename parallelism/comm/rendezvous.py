"""Where the workers of one generation meet: the controller's store, and its address.

The controller hosts one TCPStore (`host_store`) for the whole job; each generation's
workers meet under a fresh key prefix of it (`Rendezvous`), so nothing of a failed
generation is ever read by the next. The store is not authenticated: what must stay
between a generation's workers (its secret) travels in the `Rendezvous` itself.
"""

from __future__ import annotations

import datetime
import secrets
import socket
from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    """Where and under which key prefix the workers of one generation meet."""

    host: str
    port: int
    prefix: str
    timeout_s: float = 60.0
    """Joining: the store's timeout, and so how long forming the groups may take."""
    job: str = ""
    """The job whose generation this is (`WorkerGroup.job`): an abort names it too."""
    collective_s: float | None = None
    """The process groups' own timeout (c10d's), a backstop above the controller's hang
    detection (see docs/timeouts.md); None: ``timeout_s``."""
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    """The generation's secret, with which its workers prove to each other that they belong
    to it ([Note: the vote's handshake] in parallelism/commit_vote.py). It travels with
    this object -- from the controller to each worker as an argument of its ``join``, over
    Ray -- and never through the store, which anyone who reaches its port can read. Fresh
    for every `Rendezvous` made; every worker of a generation gets the same one."""


def listen_socket(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` with a port chosen by the OS (for a store master).

    Binding ourselves keeps the store on ``host`` only (127.0.0.1 for a local job) instead
    of every interface.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    return sock


def host_store(host: str) -> dist.TCPStore:
    """Start a TCPStore master on ``host`` (the controller hosts it, never a worker).

    The store takes over the listening socket and closes it when it is destroyed.
    """
    sock = listen_socket(host)
    store = dist.TCPStore(
        host,
        sock.getsockname()[1],
        None,
        True,
        datetime.timedelta(seconds=60),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        use_libuv=True,
    )
    sock.detach()
    return store
