"""`CommError`: a failure of communication with a peer, marked where it arises.

[Note: communication errors are marked at the source]
Whether an error means "a peer died or the generation was torn down" (the runtime then
recovers: the step is retried, the peer replaced) or "the user's code, or the runtime's,
is wrong" (the job stops, naming it) used to be read off its message: any ``OSError`` or
``RuntimeError`` that said "connection" or "timeout". A user's data loader that raised
``OSError("Connection reset")`` from its own server was then taken for a lost peer,
retried and blamed on the workers. So the distinction is made where it is known: every
call that talks to peers -- `parallelism.comm.StageComm`'s methods (Gloo and NCCL work,
the store, the commit vote's sockets), the DLRM exchange over a backend group, the
worker's join -- turns what fails in it into a `CommError` (`communicating`), and the
runtime classifies by type (`recovery.worker.is_comm_error`). The backend's own text is
kept in the message, the original exception as its cause.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["CommError", "talks"]

P = ParamSpec("P")
R = TypeVar("R")


class CommError(ConnectionError, RuntimeError):
    """Communication with a peer failed: it died or left, its bytes were garbled, or this
    worker's groups were torn down while it waited. A ``ConnectionError`` (and, for
    callers that expect the backend's ``RuntimeError``, one of those too)."""


_NOT_A_PEERS = (CommError, torch.OutOfMemoryError, torch.AcceleratorError)
"""Errors that pass through `talks` as they are: already marked, or this device's own
(out of memory, a CUDA error that an earlier kernel left to surface at a sync)."""


def talks(method: Callable[P, R]) -> Callable[P, R]:
    """``method``, a call that talks to peers, with what it raises as a ``RuntimeError``
    (Gloo's and NCCL's errors, c10d's ``DistError``) or an ``OSError`` (sockets) turned
    into a `CommError`, the original as its cause (see [Note: communication errors are
    marked at the source])."""

    @functools.wraps(method)
    def marked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except _NOT_A_PEERS:
            raise
        except (RuntimeError, OSError) as exc:
            raise CommError(f"{type(exc).__name__}: {exc}") from exc

    return marked
