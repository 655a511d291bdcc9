"""`ProcessGroupTransport`: a worker's state over the process group; no files, no driver.

A worker's state is its stage's module state (parameters and buffers), its optimizer
state and its step counter. The source sends a small description first (names, shapes,
dtypes, optimizer hyper-parameters, the step; JSON, see `recovery.wire`: nothing received
is unpickled, and every shape is checked before it is allocated), then every tensor as-is; the
destination receives each tensor straight into its own parameter or a freshly allocated
optimizer buffer -- no flattening copy on either side. RNG state needs no bytes, the CUDA
generators' included: every random draw is derived from ``(seed, stage, replica, step)``
(see ``parallelism/seeding.py``).

[Note: checked transfers]
Every transfer carries the sender's fingerprint of what it sends: the description holds a
XXH3-64 digest of each tensor's bytes (`recovery.integrity.fingerprint.digest`), taken from the
sender's own state, and the receiver hashes what arrived before it trusts any of it. A
mismatch raises `TransferCorrupted` naming the source and the tensors (the optimizer state
is not loaded; the parameters, received in place, hold garbage until the retry), and the
runtime retries from another source -- another live replica, or the next tier of the
recovery hierarchy (recovery/runtime/executor.py). Peer snapshots carry the digests they
were packed with the same way (`recovery.snapshots.packing`). ``flip`` on the sending side
is the injected fault: a bit flipped in flight, after the digests were taken.

[Note: digests taken ahead]
Hashing the sender's state is a third of a same-host transfer's work, and on a small
host it competes with the receiver's copy for the same cores. But a survivor whose stage
lost a replica is idle for a while before anyone asks for its state -- while the
replacement starts, joins and forms the next generation -- and its state, the last
committed step's, does not change meanwhile. So `recovery.worker.StageWorker.prepare_recovery`
starts hashing it then, on a helper thread (XXH3 runs without the GIL), and a transport's
``send`` takes those digests (`DigestsAhead`) instead of hashing again -- if they still describe
what it sends: the same tensors, at the same addresses, none written since (torch counts
every in-place write in a tensor's ``_version``), else it hashes afresh. A receive that
writes a worker's tensors behind torch's back (a process-group receive, a same-host
copy) drops them too. And a stale digest could never pass bad bytes: the receiver
hashes what it got, so a digest that no longer matches the sender's bytes fails the
check and the transfer is retried, like a corruption.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallelism.comm import GarbledMessage, ReceiveBudget, StageComm, empty_received
from recovery.errors import TransferCorrupted
from recovery.integrity.fingerprint import digest, flip_one
from recovery.state import Progress, WorkerState, describe_entry, entry_from, tensor_meta
from recovery.transport.transport import StateTransport
from recovery.wire import recv_header, send_header, tensor_spec

__all__ = [
    "DigestsAhead",
    "ProcessGroupTransport",
    "TransferStats",
    "check_digests",
    "recv_named",
    "send_named",
    "state_bytes",
]


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float


@contextmanager
def _reading(src: int) -> Iterator[None]:
    """A description that decodes but does not have the expected structure is garbled too."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise GarbledMessage(f"a state description from rank {src} does not fit: {err!r}") from None


def _digests(names: list[str], tensors: list[torch.Tensor]) -> list[list[str]]:
    """The sender's ``[name, digest]`` of each tensor it sends (see [Note: checked transfers])."""
    return [[n, digest(t)] for n, t in zip(names, tensors, strict=True)]


def _key(names: list[str], tensors: list[torch.Tensor]) -> list[tuple[str, int, int, int]]:
    """What `DigestsAhead` holds its digests valid for: each tensor's name, address, size
    and count of in-place writes."""
    return [
        (n, t.data_ptr(), t.numel() * t.element_size(), t._version)
        for n, t in zip(names, tensors, strict=True)
    ]


@dataclass
class DigestsAhead:
    """The digests of a worker's state, taken on a helper thread before anyone asked for
    them (see [Note: digests taken ahead]). `start` them; a transport's ``send`` takes them."""

    key: list[tuple[str, int, int, int]]
    thread: threading.Thread
    digests: list[list[str]]

    @classmethod
    def start(cls, state: WorkerState) -> DigestsAhead:
        _, tensors, names = state.describe()
        digests: list[list[str]] = []
        thread = threading.Thread(
            target=lambda: digests.extend(_digests(names, tensors)),
            name="checkfree-digests",
            daemon=True,
        )
        thread.start()
        return cls(_key(names, tensors), thread, digests)

    def take(self, names: list[str], tensors: list[torch.Tensor]) -> list[list[str]] | None:
        """The digests of ``tensors``, if these still are what they describe (None: hash
        them afresh)."""
        if _key(names, tensors) != self.key:
            return None
        self.thread.join()
        if len(self.digests) != len(tensors):  # the helper failed
            return None
        return self.digests


def _outgoing(
    tensors: list[torch.Tensor], names: list[str], flip: int | None
) -> list[torch.Tensor]:
    """What to send: the tensors, or (``flip``: the injected fault) copies with one bit
    flipped -- the digests are the originals', so the flip is one made in flight."""
    if flip is None:
        return tensors
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    flip_one(list(zip(names, copies, strict=True)), flip)
    return copies


def check_digests(
    meta: dict[str, Any],
    targets: list[torch.Tensor],
    src: int,
    rank: int,
    got: list[str] | None = None,
) -> None:
    """Raise `TransferCorrupted` if what arrived in ``targets`` differs from the sender's
    digests (see [Note: checked transfers]). ``got``: the targets' digests, if taken already
    (as they landed)."""
    with _reading(src):
        sent = [(str(name), str(hexdigest)) for name, hexdigest in meta["digests"]]
    if len(sent) != len(targets):
        raise GarbledMessage(
            f"a state description from rank {src} with {len(sent)} digests for "
            f"{len(targets)} tensors"
        )
    if got is None:
        got = [digest(t) for t in targets]
    bad = tuple(n for (n, d), g in zip(sent, got, strict=True) if g != d)
    if bad:
        raise TransferCorrupted(
            f"state from rank {src} to rank {rank} arrived corrupted: {', '.join(bad)} "
            "differ from the sender's fingerprint",
            found=[(rank, src, bad)],
        )


class ProcessGroupTransport(StateTransport):
    """A worker's state over the process group (Gloo or NCCL): the description, then every
    tensor as-is, received straight into the receiver's own tensors."""

    def send(
        self,
        dst: int,
        state: WorkerState,
        *,
        flip: int | None = None,
        ahead: DigestsAhead | None = None,
        wait: bool = True,
    ) -> int:
        """Send ``state`` to global rank ``dst`` (see `StateTransport.send`). Returns the
        bytes sent.

        ``wait=False`` returns once the sends are posted (finish them with
        ``comm.wait_sends()``), so a worker can receive meanwhile.
        """
        meta, tensors, names = state.describe()
        taken = ahead.take(names, tensors) if ahead is not None else None
        outgoing = _outgoing(tensors, names, flip)
        nbytes = sum(t.numel() * t.element_size() for t in outgoing)
        header = self._post(dst, meta, outgoing, lambda: taken or _digests(names, tensors), wait)
        return int(header + nbytes)

    def _post(
        self,
        dst: int,
        meta: dict[str, Any],
        outgoing: list[torch.Tensor],
        digests: Callable[[], list[list[str]]],
        wait: bool,
    ) -> int:
        """Send the description (the digests in it), then the tensors. Returns the bytes of
        the description."""
        meta["digests"] = digests()
        header = send_header(self.comm, dst, meta)
        self._post_tensors(dst, outgoing, wait)
        return header

    def _post_tensors(self, dst: int, outgoing: list[torch.Tensor], wait: bool) -> None:
        for t in outgoing:
            self.comm.isend(t.detach(), dst)
        if wait:
            self.comm.wait_sends()

    def recv(self, src: int, state: WorkerState) -> tuple[Progress, int]:
        """Replace ``state``'s module and optimizer state with what global rank ``src``
        sends (see `StateTransport.recv`, for what it raises); returns the sender's
        progress (for the caller to adopt) and the bytes received."""
        comm = self.comm
        meta, header = recv_header(comm, src)
        with _reading(src):  # its structure first: what does not fit is garbled
            for _name, shape, dtype in meta["model"]:
                tensor_spec(shape, dtype)
            if not isinstance(meta["progress"], Progress):
                raise TypeError(f"progress {meta['progress']!r}")
        try:
            targets = state.model_targets(meta)
        except ValueError as err:
            raise RuntimeError(f"state from rank {src}: {err}") from None
        # Allocate every destination first, then post all receives at once so that the bytes
        # stream without a round trip per tensor. Model tensors are received in place.
        budget = ReceiveBudget(comm.device)  # the model's tensors are the receiver's own
        with _reading(src):
            opt_state = state.optimizer_state(
                meta, lambda shape, dtype: _empty(shape, dtype, budget), targets
            )
        header += self._receive(src, meta, targets)
        with _reading(src):
            progress = state.load(meta, opt_state)
        total = header + sum(t.numel() * t.element_size() for t in targets)
        return progress, int(total)

    def _receive(self, src: int, meta: dict[str, Any], targets: list[torch.Tensor]) -> int:
        """Fill ``targets`` with what ``src`` sends and check it against the sender's
        digests. Returns the bytes of any header received after the description (none here).

        Raises:
            GarbledMessage: for a description that offers a same-host copy (only
                `SameHostTransport` takes one).
            TransferCorrupted: if what arrived differs from the sender's digests.
        """
        if meta.get("same_host") is not None:
            raise GarbledMessage(
                f"a state description from rank {src} offers a same-host copy, which a "
                "process-group receive does not take"
            )
        self.comm.recv_many(targets, src)
        check_digests(meta, targets, src, self.comm.rank)
        return 0


def state_bytes(state: WorkerState) -> int:
    """Bytes of a worker's state (what a transfer moves, less the small description)."""
    _, tensors, _ = state.describe()
    return sum(t.numel() * t.element_size() for t in tensors)


def send_named(
    comm: StageComm, dst: int, module: nn.Module, optimizer: torch.optim.Optimizer, *, moments: bool
) -> int:
    """Send this stage's state by name -- weights, and per-parameter optimizer state if
    ``moments`` -- to a worker of *another* stage (a CheckFree rebuild). Returns bytes."""
    model = {k: v.detach() for k, v in module.state_dict().items()}
    opt: dict[str, dict[str, torch.Tensor]] = {}
    if moments:
        for name, param in module.named_parameters():
            entry = optimizer.state.get(param)
            if entry:
                opt[name] = dict(entry)
    tensors: list[torch.Tensor] = list(model.values())
    names = list(model)
    meta_opt = {
        name: describe_entry(entry, tensors, names, f"optim.{name}") for name, entry in opt.items()
    }
    meta = {"model": [(k, *tensor_meta(v)[1:]) for k, v in model.items()], "moments": meta_opt}
    meta["digests"] = _digests(names, tensors)
    header = send_header(comm, dst, meta)
    for t in tensors:
        comm.isend(t, dst)
    comm.wait_sends()
    return int(header + sum(t.numel() * t.element_size() for t in tensors))


def recv_named(
    comm: StageComm, src: int
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], int]:
    """Receive what `send_named` sends: ``(state_dict, moments by parameter name, bytes)``.

    Raises:
        GarbledMessage: if the description is not one `send_named` sends.
        TransferCorrupted: if what arrived differs from the sender's digests.
    """
    meta, header = recv_header(comm, src)
    budget = ReceiveBudget(comm.device)
    with _reading(src):
        state = {str(k): _empty(shape, dtype, budget) for k, shape, dtype in meta["model"]}
        targets = list(state.values())
        moments = {
            str(name): entry_from(entry, lambda shape, dtype: _empty(shape, dtype, budget), targets)
            for name, entry in meta["moments"].items()
        }
    comm.recv_many(targets, src)
    check_digests(meta, targets, src, comm.rank)
    return state, moments, header + sum(t.numel() * t.element_size() for t in targets)


def _empty(shape: object, dtype: object, budget: ReceiveBudget) -> torch.Tensor:
    """An uninitialised tensor of a received shape and dtype on ``budget``'s device,
    checked first (see [Note: what a received message may allocate] in
    parallelism/comm/wire.py).

    Raises:
        GarbledMessage: for a shape or dtype out of bounds, one over the message's budget,
            or one that cannot be allocated.
    """
    size, kind = tensor_spec(shape, dtype)
    return empty_received(size, kind, budget.device, "a state description", budget)
