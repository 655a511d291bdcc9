"""`SameHostTransport`: the receiver copies the sender's tensors straight out of its memory.

[Note: same-host transfer]
Over Gloo on one host a state transfer crosses TCP loopback: the kernel copies every byte
twice, in socket-buffer-sized pieces, and a 100 MB state moves at a fraction of what one
memcpy does. Between two workers on the same host the sender instead puts an *offer* in
the transfer's description -- its host, its pid, and the address and size of each tensor
it sends -- and waits; the receiver copies every tensor out of the sender's address space
into its own with one ``process_vm_readv`` call (Linux cross-memory attach, what MPI
libraries use between ranks on a node: a single copy, no buffer in between), then
answers over the process group, `TAKEN` -- or `DECLINED` (another host, an offer it has no
reason to trust, a read that fails, or a kernel or container that does not allow the call:
[Note: what a same-host receiver trusts]), and the tensors follow over Gloo as before.
What arrives is checked against the sender's digests either way ([Note: checked
transfers] in recovery/transport/process_group.py). `SameHostTransport` is the process-group
transport with this in place of its tensor sends: it offers whenever it can (Gloo, CPU
tensors, a sender that waits) and falls back by itself otherwise, so a receiver takes
either.

Hashing is a third of the work (XXH3 runs at ~28 GB/s on one core, the cross-memory copy
at ~9), so it is taken off the copy's path on both sides. The sender's digests are
usually ready before anyone asks: a survivor hashes its state while the replacement
starts ([Note: digests taken ahead] in recovery/transport/process_group.py), and
otherwise it sends its offer first and its digests after, hashing while the receiver
copies. The receiver reads
on helper threads (`READERS`, batches of whole tensors in turn) -- the copy runs in the
kernel, without the GIL -- `CHUNK_BYTES` at a time, and hashes each piece right after it
lands, while it is still in the cache, instead of reading a batch out to memory and back.
Measured on the 2-core machine, a 315 MB state (the 100 MB 1x2 job's weights and AdamW
moments): the receiver spent ~72 ms of CPU in the kernel's copy and ~28 ms hashing, on
two threads, ~59 ms of wall time, with no page faults; the warm-spare transfer phase of
the 100 MB job went from 69-91 ms to 53-71 ms (alternating runs). The two cores are the
limit: the copy and the hashing share them with everything else the host runs.

Why not a shared-memory file: one (``memfd``) written by the sender and mapped by the
receiver costs two copies and a page fault per page on each side; measured on the 2-core
machine for 100 MB it took ~70 ms against ~20 ms for ``process_vm_readv`` into memory the
receiver already has (a warm memcpy there: ~14 ms). `scripts/bench.py recovery` prints
the transfer rate against a memcpy of the same bytes.

Nothing is shared, so nothing can be left behind: a sender killed mid-transfer takes its
memory with it, and the receiver's read fails (``ESRCH``, or a short read); it declines,
and the process group then finds the sender gone -- a lost connection, and the runtime
retries from another source. A receiver killed mid-read leaves the sender waiting for an
answer that never comes: a lost peer, as over Gloo.

[Note: what a same-host receiver trusts]
An offer is input from a peer like any other, and reading another process's memory is
only sound if the pid is the sender's. So the receiver copies nothing unless all of
these hold, and otherwise declines -- the bytes then come over the process group, from
the peer it is connected to, and are checked against the digests as ever:

- the same host (host name and boot id) and the same *pid namespace* (``/proc/self/ns/pid``,
  carried in the offer): containers with host networking share the first two, and a pid
  of another namespace names another process here;
- the pid holds the offer's *proof*: every offer carries a fresh random 16-byte nonce and
  the address where the sender wrote it, and the receiver reads those 16 bytes out of the
  named pid first (``hmac.compare_digest``). The offer arrived over the connection to the
  sending rank, so only a process that rank controls holds the nonce there: a wrong or
  stale pid (another process, a fork of the sender made before the offer) is declined
  before any tensor is read. Nothing is learnt from the membership: the proof needs no
  pid table to stay current across generations, and works for workers in threads of one
  process alike;
- the regions fit the receiver's tensors (the sizes its description already checked),
  and every read succeeds: ``ESRCH``, ``EFAULT``, a short read of nothing -- any failure,
  even after some pieces landed -- declines this offer; ``EPERM``, ``EACCES`` or
  ``ENOSYS`` (a kernel or container that forbids the call) decline every later one too.

What a read copies is still hashed and checked against the sender's digests, so an
address the sender maps but did not mean yields bytes that the check refuses.
"""

from __future__ import annotations

import ctypes
import errno
import hmac
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import xxhash

from recovery.integrity.fingerprint import raw_bytes
from recovery.transport.process_group import ProcessGroupTransport, check_digests
from recovery.wire import recv_header, send_header

__all__ = ["DECLINED", "HOST", "TAKEN", "SameHostTransport", "offer", "read_offer"]

log = logging.getLogger("checkfree")

TAKEN, DECLINED = 1, 0
"""The receiver's answer to an offer."""

_IOV_MAX = 1024
"""Regions per ``process_vm_readv`` call (the kernel's ``UIO_MAXIOV``)."""

BATCH_BYTES = 4 << 20
"""A reader takes whole tensors of at least this many bytes together (a batch), so that
the readers share the work in turn."""

CHUNK_BYTES = 512 << 10
"""A reader copies a batch this many bytes at a time and hashes each piece as it lands,
from the cache (a core's L2 holds a piece and its hashing)."""

READERS = 2
"""Helper threads reading batches at once (batch k on thread k mod READERS): one thread's
``process_vm_readv`` reaches about two thirds of a memcpy's rate on the 2-core machine,
two about a memcpy's (see [Note: same-host transfer])."""


def _host() -> str:
    """This host, as two processes on it agree and no two hosts do: name and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


HOST = _host()


def _pid_namespace() -> str:
    """This process's pid namespace (``pid:[inode]``): two processes agree on what a pid
    names only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


PID_NAMESPACE = _pid_namespace()

_PROOF_BYTES = 16


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load() -> Any:
    """libc's ``process_vm_readv``, or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    vec = ctypes.POINTER(_IoVec)
    call.argtypes = [ctypes.c_int, vec, ctypes.c_ulong, vec, ctypes.c_ulong, ctypes.c_ulong]
    call.restype = ctypes.c_ssize_t
    return call


_READV = _load()
_refused: list[str] = []
"""Why the kernel refused a read once (then this process stops trying)."""


class _Offer(dict[str, Any]):
    """An offer (a plain dict on the wire) that keeps its proof's buffer alive as long as
    the offer itself is."""

    proof: Any = None


class _Declined(Exception):
    """Why this offer is not taken (the bytes then come over the process group)."""


def usable() -> bool:
    """Whether this process can take an offer (the call exists and was never refused)."""
    return _READV is not None and not _refused


def offer(tensors: Sequence[torch.Tensor]) -> dict[str, Any] | None:
    """The offer for ``tensors`` (CPU, contiguous, kept alive and unchanged by the caller
    until the receiver answers), or None if they cannot be offered. The caller keeps the
    returned object itself alive until then too: it holds the offer's proof (see [Note:
    what a same-host receiver trusts])."""
    if _READV is None or not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    nonce = secrets.token_bytes(_PROOF_BYTES)
    proof = ctypes.create_string_buffer(nonce, _PROOF_BYTES)
    made = _Offer(
        host=HOST,
        pidns=PID_NAMESPACE,
        pid=os.getpid(),
        proof=[ctypes.addressof(proof), nonce.hex()],
        regions=[[t.data_ptr(), t.numel() * t.element_size()] for t in tensors],
    )
    made.proof = proof
    return made


def _checked(made: object, targets: Sequence[torch.Tensor]) -> tuple[int, list[Any]]:
    """The pid and regions of an offer this receiver may read, its proof checked in the
    named process (see [Note: what a same-host receiver trusts]).

    Raises:
        _Declined: naming what does not hold.
    """
    if not isinstance(made, dict):
        raise _Declined(f"an offer that is not a dict ({type(made).__name__})")
    if made.get("host") != HOST:
        raise _Declined(f"another host ({made.get('host')!r})")
    if made.get("pidns") != PID_NAMESPACE or PID_NAMESPACE == "?":
        raise _Declined(f"another pid namespace ({made.get('pidns')!r}, here {PID_NAMESPACE})")
    if not usable():
        raise _Declined("this process cannot read another's memory")
    try:
        pid = int(made["pid"])
        address, nonce = int(made["proof"][0]), bytes.fromhex(made["proof"][1])
        regions = [(int(a), int(size)) for a, size in made["regions"]]
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise _Declined(f"an offer that does not decode ({err!r})") from None
    sizes = [t.numel() * t.element_size() for t in targets]
    if pid <= 0 or len(nonce) != _PROOF_BYTES or address <= 0:
        raise _Declined("an offer without a pid or a proof")
    if [n for _, n in regions] != sizes or any(a <= 0 < n for a, n in regions):
        raise _Declined(f"an offer of {len(regions)} regions that does not fit the state")
    found = ctypes.create_string_buffer(_PROOF_BYTES)
    _read(pid, [(address, _PROOF_BYTES, ctypes.addressof(found))])
    if not hmac.compare_digest(found.raw, nonce):
        raise _Declined(f"pid {pid} does not hold the offer's proof (not the sender)")
    return pid, regions


def read_offer(made: object, targets: Sequence[torch.Tensor], src: int) -> list[str] | None:
    """The receiver's side: copy an offer's tensors into ``targets`` and return the digest
    of each one's bytes as it landed (`recovery.integrity.fingerprint.digest`'s), for the caller to
    check against the sender's. Returns None -- the tensors must then come over the process
    group -- when the offer is not one to trust or the copy fails (see [Note: what a
    same-host receiver trusts]); ``targets`` may then hold part of a copy.

    Helper threads (`READERS`) copy batches of whole tensors in turn, `CHUNK_BYTES` at a
    time, and hash each piece right after it lands, while it is still in the cache: both
    run without the GIL (the copy in the kernel, XXH3 in C). Nothing is read after this
    returns.
    """
    try:
        return _copy(made, targets)
    except _Declined as why:
        # Another host is the common case, and a kernel that refuses was said once.
        if isinstance(made, dict) and made.get("host") == HOST and usable():
            log.warning("a same-host offer from rank %d declined, over Gloo instead: %s", src, why)
        return None


def _copy(made: object, targets: Sequence[torch.Tensor]) -> list[str]:
    """`read_offer`'s copy. Raises `_Declined` if it is not made."""
    pid, regions = _checked(made, targets)
    staged = [
        t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        for t in targets
    ]
    batches = _batches(regions)
    hashers = [xxhash.xxh3_64() for _ in targets]
    digests: list[str] = [""] * len(targets)
    readers = max(1, min(READERS, len(batches)))
    stop = threading.Event()
    outcome: list[BaseException] = []

    def reader(first: int) -> None:
        try:
            for k in range(first, len(batches), readers):
                for piece in _pieces(batches[k], regions, staged, hashers):
                    if stop.is_set():
                        return
                    _read(pid, [(a, n, dst) for a, n, dst, _ in piece])
                    for *_, hashing in piece:
                        hashing()
                for i in batches[k]:
                    digests[i] = hashers[i].hexdigest()
        except BaseException as exc:
            outcome.append(exc)
            stop.set()

    threads = [
        threading.Thread(target=reader, args=(first,), name="checkfree-same-host", daemon=True)
        for first in range(readers)
    ]
    try:
        for thread in threads:
            thread.start()
    finally:
        for thread in threads:
            if thread.ident is not None:
                thread.join()
    for failed in outcome:  # a decline first: another reader may have failed for its sake
        if isinstance(failed, _Declined):
            raise failed
    for failed in outcome:
        raise failed
    for target, landed in zip(targets, staged, strict=True):
        if landed is not target:
            target.copy_(landed)
    return digests


def _batches(regions: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Targets grouped into reads of at least `BATCH_BYTES` (small tensors together), at
    most ``_IOV_MAX`` regions each."""
    batches: list[list[int]] = [[]]
    size = 0
    for i, (_, n) in enumerate(regions):
        if batches[-1] and (size >= BATCH_BYTES or len(batches[-1]) >= _IOV_MAX):
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += n
    return [b for b in batches if b]


def _pieces(
    batch: list[int],
    regions: Sequence[tuple[int, int]],
    staged: Sequence[torch.Tensor],
    hashers: Sequence[Any],
) -> Iterator[list[tuple[int, int, int, Callable[[], None]]]]:
    """A batch's reads, in order, in pieces of at most `CHUNK_BYTES` (small tensors
    together, a large one in several): ``(remote address, size, local address, hash
    what landed)`` per region."""
    piece: list[tuple[int, int, int, Callable[[], None]]] = []
    size = 0
    for i in batch:
        address, total = regions[i]
        local, view = staged[i].data_ptr(), raw_bytes(staged[i])
        for offset in range(0, total, CHUNK_BYTES):
            n = min(CHUNK_BYTES, total - offset)
            if piece and (size + n > CHUNK_BYTES or len(piece) >= _IOV_MAX):
                yield piece
                piece, size = [], 0
            hashing = partial(hashers[i].update, view[offset : offset + n])
            piece.append((address + offset, n, local + offset, hashing))
            size += n
    if piece:
        yield piece


def _read(pid: int, jobs: list[tuple[int, int, int]]) -> None:
    """One ``process_vm_readv`` of ``(remote address, size, local address)`` jobs, resumed
    after short reads.

    Raises:
        _Declined: if the read fails (see [Note: what a same-host receiver trusts]).
    """
    while jobs:
        n = len(jobs)
        local = (_IoVec * n)(*[_IoVec(dst, size) for _, size, dst in jobs])
        remote = (_IoVec * n)(*[_IoVec(address, size) for address, size, _ in jobs])
        done = _READV(pid, local, n, remote, n, 0)
        if done < 0:
            code = ctypes.get_errno()
            # A kernel that forbids the call: said once, whichever reader met it first.
            if code in (errno.EPERM, errno.EACCES, errno.ENOSYS) and not _refused:
                _refused.append(os.strerror(code))
                log.warning(
                    "same-host transfers fall back to Gloo: process_vm_readv refused (%s)",
                    os.strerror(code),
                )
            raise _Declined(f"process_vm_readv of pid {pid}: {os.strerror(code)}")
        if done == 0:
            raise _Declined(f"process_vm_readv of pid {pid} read nothing")
        while done:  # drop what was read; a short read stops at a region boundary or in one
            address, size, dst = jobs[0]
            if done >= size:
                jobs.pop(0)
                done -= size
            else:
                jobs[0] = (address + done, size - done, dst + done)
                done = 0


class SameHostTransport(ProcessGroupTransport):
    """A worker's state copied out of the sender's memory by a receiver on its host (see
    [Note: same-host transfer]); over the process group where that cannot be done: another
    host, a kernel that refuses the read, tensors not on the CPU, NCCL, a send that does
    not wait. Its receive takes what either way sends."""

    def _post(
        self,
        dst: int,
        meta: dict[str, Any],
        outgoing: list[torch.Tensor],
        digests: Callable[[], list[list[str]]],
        wait: bool,
    ) -> int:
        """Offer the tensors; the receiver starts copying at once, and the digests follow
        once taken, here, while it copies. Returns the bytes of both headers."""
        made = offer(outgoing) if wait and self.comm.backend == "gloo" else None
        if made is None:
            return super()._post(dst, meta, outgoing, digests, wait)
        meta["same_host"] = made
        header = send_header(self.comm, dst, meta)
        header += send_header(self.comm, dst, digests())
        answer = self.comm.recv(torch.zeros(1, dtype=torch.int64), dst)
        if int(answer) == TAKEN:  # copied out of our memory: nothing to send
            self.comm.wait_sends()
        else:
            self._post_tensors(dst, outgoing, wait)
        return header

    def _receive(self, src: int, meta: dict[str, Any], targets: list[torch.Tensor]) -> int:
        """Fill ``targets`` out of the sender's memory if it offered that and is on this
        host, else over the process group, and check them against the sender's digests.
        Returns the bytes of the digests' own header (an offer's come after it).

        Raises:
            TransferCorrupted: if what arrived differs from the sender's digests.
        """
        made = meta.get("same_host")
        if made is None:
            return super()._receive(src, meta, targets)
        got = read_offer(made, targets, src)  # hashed as they land
        meta["digests"], size = recv_header(self.comm, src)
        self.comm.isend(torch.tensor([DECLINED if got is None else TAKEN]), src)
        self.comm.wait_sends()
        if got is None:
            self.comm.recv_many(targets, src)
        check_digests(meta, targets, src, self.comm.rank, got)
        return size
