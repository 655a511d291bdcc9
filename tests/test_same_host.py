"""`SameHostTransport`: state copied out of the sender's memory on one host ([Note: same-host
transfer] in recovery/transport/same_host.py): the same bits as over Gloo, and a fallback
to Gloo whenever the copy cannot be trusted or made -- another host or pid namespace, a
pid that is not the sender's, an offer that does not fit, a kernel that refuses or a read
that fails -- and a source killed mid-transfer retried. What every transport must do is
in tests/test_transport.py."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from parallelism import Topology
from recovery.errors import TransferCorrupted
from recovery.integrity.fingerprint import digest
from recovery.runtime import Phase
from recovery.state import Progress, WorkerState
from recovery.transport import (
    DigestsAhead,
    ProcessGroupTransport,
    SameHostTransport,
    StateTransport,
    process_group,
    same_host,
)
from tests.jobs import drive, in_threads, make
from tests.test_comm import _pair
from tests.test_controller import assert_equal_states
from tests.test_reentrant import FIRST, SOURCE, TOP, once, run
from tests.workloads import mlp_spec

pytestmark = pytest.mark.skipif(
    not same_host.usable(), reason="this kernel does not allow process_vm_readv"
)


PROGRESS = Progress(7)


def _way(local: bool) -> type[StateTransport]:
    """The sender's transport: an offer of its memory (``local``), or the process group.
    A receiver is always a `SameHostTransport`, which takes either, as a worker's is."""
    return SameHostTransport if local else ProcessGroupTransport


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stage with parameters, a buffer, odd sizes and a trained AdamW."""
    torch.manual_seed(seed)
    module = torch.nn.Sequential(
        torch.nn.Linear(37, 129), torch.nn.BatchNorm1d(129), torch.nn.Linear(129, 5)
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for _ in range(2):
        module(torch.randn(8, 37)).square().mean().backward()
        optimizer.step()
    return module, optimizer


def _blank() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    module, _ = _state(1)
    with torch.no_grad():
        for t in module.state_dict().values():
            t.zero_()
    return module, torch.optim.AdamW(module.parameters(), lr=1.0)


def _transfer(local: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """Send `_state(0)` from rank 0 to a blank rank 1; returns the receiver's state."""
    comms = _pair(Topology(2, 1))
    module, optimizer = _state(0)
    other, other_opt = _blank()
    try:
        sent, (progress, nbytes) = in_threads(
            [
                lambda: _way(local)(comms[0]).send(1, WorkerState(module, optimizer, PROGRESS)),
                lambda: SameHostTransport(comms[1]).recv(
                    0, WorkerState(other, other_opt, Progress())
                ),
            ]
        )
    finally:
        for comm in comms:
            comm.close()
    assert (progress, nbytes) == (PROGRESS, sent)
    return other, other_opt, nbytes


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """What each receive's `read_offer` returned (True: copied out of the sender's memory)."""
    answers: list[bool] = []
    real = same_host.read_offer

    def spy(*args: Any, **kwargs: Any) -> list[str] | None:
        got = real(*args, **kwargs)
        answers.append(got is not None)
        return got

    monkeypatch.setattr(same_host, "read_offer", spy)
    yield answers


def _assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    """The same bits: every model tensor, and every optimizer entry of either side (an
    entry one side lacks is a difference, not a pass)."""
    (ma, oa, _), (mb, ob, _) = a, b
    assert ma.state_dict().keys() == mb.state_dict().keys()
    for x, y in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"], "no optimizer state"
    for key in sa["state"]:
        assert sa["state"][key].keys() == sb["state"][key].keys(), key
        for name, value in sa["state"][key].items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)


def test_a_same_host_copy_and_gloo_deliver_the_same_bits(taken: list[bool]) -> None:
    by_memory = _transfer(local=True)
    assert taken == [True]
    by_gloo = _transfer(local=False)
    assert taken == [True]  # no offer made: the receiver never read one
    _assert_same(by_memory, by_gloo)
    source, source_opt = _state(0)
    _assert_same(by_memory, (source, source_opt, 0))


def test_an_offer_from_another_host_falls_back_to_gloo(
    taken: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = same_host.offer
    monkeypatch.setattr(
        same_host, "offer", lambda tensors: {**real(tensors), "host": "elsewhere/boot"}
    )
    received = _transfer(local=True)
    assert taken == [False]
    _assert_same(received, _transfer(local=False))


def test_a_kernel_that_refuses_the_read_falls_back_to_gloo(
    taken: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Containers often forbid process_vm_readv (EPERM): the receiver declines, once and
    for all, and the bytes come over Gloo."""

    def refuse(*_: Any) -> int:
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(same_host, "_READV", refuse)
    monkeypatch.setattr(same_host, "_refused", [])
    received = _transfer(local=True)
    assert taken == [False] and same_host._refused == [os.strerror(errno.EPERM)]
    assert not same_host.usable()
    _assert_same(received, _transfer(local=False))


def test_an_offer_from_a_sender_that_is_gone_is_declined() -> None:
    """ESRCH: the receiver declines, and the process group says whether the sender is
    gone (a lost peer there) -- the read itself never fails the transfer."""
    source = torch.arange(1000.0)
    made = same_host.offer([source])
    assert made is not None
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)  # a pid that existed and is gone
    assert same_host.read_offer({**made, "pid": child}, [torch.empty(1000)], src=3) is None
    assert same_host.usable()  # this offer declined, not every later one


@pytest.mark.parametrize(
    "bad",
    [
        {"regions": [[1, 4000], [1, 4]]},  # more regions than tensors
        {"regions": [[1, 40]]},  # a size that is not the tensor's
        {"regions": [[0, 4000]]},  # no address
        {"regions": [[4096, 4000]]},  # an address the sender does not map: EFAULT
        {"pid": "x"},
        {"regions": "x"},
    ],
)
def test_an_offer_that_does_not_fit_is_declined(bad: dict[str, Any]) -> None:
    source = torch.arange(1000.0)
    made = same_host.offer([source])
    assert made is not None
    assert same_host.read_offer({**made, **bad}, [torch.empty(1000)], src=1) is None


def test_a_read_resumes_after_short_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may stop a read early (at a region boundary or inside one): the rest
    is read again, and every byte lands where it belongs."""
    real = same_host._READV
    calls = []

    def short(pid: int, local: Any, n: int, remote: Any, m: int, flags: int) -> int:
        calls.append(n)
        first = remote[0]
        take = max(1, first.iov_len // 3)  # a third of the first region, at most
        one = (same_host._IoVec * 1)(same_host._IoVec(local[0].iov_base, take))
        rem = (same_host._IoVec * 1)(same_host._IoVec(first.iov_base, take))
        return int(real(pid, one, 1, rem, 1, flags))

    monkeypatch.setattr(same_host, "_READV", short)
    sources = [torch.randn(1000), torch.randn(7), torch.arange(300, dtype=torch.int64)]
    targets = [torch.empty_like(t) for t in sources]
    made = same_host.offer(sources)
    assert made is not None
    assert same_host.read_offer(made, targets, src=0) == [digest(t) for t in sources]
    assert len(calls) > 3
    assert all(torch.equal(a, b) for a, b in zip(sources, targets, strict=True))


def _helpers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "checkfree-same-host"]


@pytest.mark.parametrize("chunk", [8, 1 << 20])
def test_each_tensor_is_hashed_piece_by_piece_as_it_lands(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers copy in pieces (a tensor in several, or several tensors in one) and hash
    each as it lands: the digests are `digest`'s of the whole tensors, a non-contiguous
    target gets its bytes, and nothing is read after the call returns (the helpers are
    gone)."""
    monkeypatch.setattr(same_host, "BATCH_BYTES", 1)  # a batch per tensor
    monkeypatch.setattr(same_host, "CHUNK_BYTES", chunk)
    sources = [
        torch.randn(1000),
        torch.randn(7).bfloat16(),
        torch.randn(3, 5).t(),
        torch.arange(300),
        torch.empty(0),
        torch.tensor(2.5),
    ]
    offered = [t.contiguous() for t in sources]
    targets = [torch.empty(3, 5).t() if t.dim() == 2 else torch.empty_like(t) for t in sources]
    made = same_host.offer(offered)
    assert made is not None
    got = same_host.read_offer(made, targets, src=0)
    assert got == [digest(t) for t in sources]
    assert all(torch.equal(a, b) for a, b in zip(sources, targets, strict=True))
    assert _helpers() == []


def test_a_sender_lost_in_the_middle_of_a_pipelined_read_is_declined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure after some pieces landed declines the offer (the process group then
    delivers every byte, or finds the sender gone), and the helper threads are gone
    before it does (nothing writes into the targets afterwards)."""
    monkeypatch.setattr(same_host, "BATCH_BYTES", 1)
    monkeypatch.setattr(same_host, "CHUNK_BYTES", 64)
    real = same_host._READV
    lock = threading.Lock()
    calls = []

    def gone_after_two(*args: Any) -> int:
        with lock:
            calls.append(1)
            count = len(calls)
        if count > 2:
            ctypes.set_errno(errno.ESRCH)
            return -1
        return int(real(*args))

    monkeypatch.setattr(same_host, "_READV", gone_after_two)
    sources = [torch.randn(100) for _ in range(5)]
    made = same_host.offer(sources)
    assert made is not None
    assert same_host.read_offer(made, [torch.empty(100) for _ in sources], 4) is None
    assert _helpers() == []


@pytest.mark.parametrize("fail_at", [None, 7])
def test_several_readers_land_batches_out_of_order(
    fail_at: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers take batches in turn and land them out of order; every digest is still
    its own tensor's. A read failing on one reader declines the offer, and every reader
    is gone when it does."""
    monkeypatch.setattr(same_host, "BATCH_BYTES", 1)
    monkeypatch.setattr(same_host, "READERS", 3)
    real = same_host._READV
    lock = threading.Lock()
    reads: list[int] = []

    def slow_odd(pid: int, local: Any, n: int, remote: Any, m: int, flags: int) -> int:
        with lock:
            reads.append(1)
            count = len(reads)
        if count == fail_at:
            ctypes.set_errno(errno.ESRCH)
            return -1
        if count % 2:
            time.sleep(0.01)  # every other read late: later batches land first
        return int(real(pid, local, n, remote, m, flags))

    monkeypatch.setattr(same_host, "_READV", slow_odd)
    sources = [torch.randn(50 + i) for i in range(12)]
    targets = [torch.empty_like(t) for t in sources]
    made = same_host.offer(sources)
    assert made is not None
    if fail_at is None:
        assert same_host.read_offer(made, targets, 0) == [digest(t) for t in sources]
        assert all(torch.equal(a, b) for a, b in zip(sources, targets, strict=True))
    else:
        assert same_host.read_offer(made, targets, 2) is None
    assert _helpers() == []


def test_a_pipelined_read_the_kernel_refuses_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(same_host, "BATCH_BYTES", 1)

    def refuse(*_: Any) -> int:
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(same_host, "_READV", refuse)
    monkeypatch.setattr(same_host, "_refused", [])
    sources = [torch.randn(100) for _ in range(3)]
    made = same_host.offer(sources)
    assert made is not None
    assert same_host.read_offer(made, [torch.empty(100) for _ in sources], 0) is None
    assert _helpers() == []


def test_a_transfer_in_batches_gives_the_same_bits_as_gloo(
    taken: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a `SameHostTransport` with every tensor a batch of its own, read in small
    pieces: the digests taken as they land and the sender's check the same bits."""
    monkeypatch.setattr(same_host, "BATCH_BYTES", 1)
    monkeypatch.setattr(same_host, "CHUNK_BYTES", 100)
    by_memory = _transfer(local=True)
    assert taken == [True]
    _assert_same(by_memory, _transfer(local=False))


def test_a_source_killed_mid_transfer_is_retried_and_the_job_ends_exact(
    taken: list[bool],
) -> None:
    """Nothing is shared, so nothing is left to clean up: the copy is retried from
    another replica, the job ends bit-identical to one that never failed, and no
    shared-memory segment appeared meanwhile."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    controller, _ = run(once(SOURCE, "send_state", delay=0.001))
    assert controller.phase is Phase.FINISHED, controller.error
    assert True in taken  # a copy came out of a sender's memory
    oracle, _ = make(mlp_spec(), TOP)
    drive(oracle)
    assert_equal_states(controller.final_states, oracle.final_states)  # type: ignore[attr-defined]
    assert (set(shm.iterdir()) if shm.is_dir() else set()) <= before


def _send_with(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ahead: DigestsAhead | None,
    local: bool,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    comms = _pair(Topology(2, 1))
    other, other_opt = _blank()
    try:
        results = in_threads(
            [
                lambda: _way(local)(comms[0]).send(
                    1, WorkerState(module, optimizer, PROGRESS), ahead=ahead
                ),
                lambda: SameHostTransport(comms[1]).recv(
                    0, WorkerState(other, other_opt, Progress())
                ),
            ]
        )
    finally:
        for comm in comms:
            comm.close()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return other, other_opt, 0


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors the sender hashed (outside `DigestsAhead`'s helper thread)."""
    counts: list[int] = []
    real = process_group._digests

    def spy(names: list[str], tensors: list[torch.Tensor]) -> list[list[str]]:
        if threading.current_thread().name != "checkfree-digests":
            counts.append(len(tensors))
        return real(names, tensors)

    monkeypatch.setattr(process_group, "_digests", spy)
    return counts


@pytest.mark.parametrize("local", [True, False])
def test_digests_taken_ahead_are_sent_while_the_state_is_unchanged(
    local: bool, hashed: list[int]
) -> None:
    """[Note: digests taken ahead]: what a survivor hashed while it waited is sent as is."""
    module, optimizer = _state(0)
    ahead = DigestsAhead.start(WorkerState(module, optimizer, PROGRESS))
    received = _send_with(module, optimizer, ahead, local)
    assert hashed == []
    _assert_same(received, (*_state(0), 0))


@pytest.mark.parametrize("local", [True, False])
def test_digests_taken_before_a_write_are_not_used(local: bool, hashed: list[int]) -> None:
    """An in-place write after the digests were taken (torch counts it): the sender hashes
    afresh and the state arrives intact."""
    module, optimizer = _state(0)
    ahead = DigestsAhead.start(WorkerState(module, optimizer, PROGRESS))
    ahead.thread.join()
    with torch.no_grad():
        next(module.parameters()).add_(1.0)
    received = _send_with(module, optimizer, ahead, local)
    assert len(hashed) == 1
    _assert_same(received, (module, optimizer, 0))


@pytest.mark.parametrize("local", [True, False])
def test_a_stale_digest_cannot_pass_bytes_that_changed(local: bool) -> None:
    """A write torch does not count (here through numpy) leaves the digests taken ahead
    stale: the receiver's check refuses the bytes rather than trusting them."""
    module, optimizer = _state(0)
    ahead = DigestsAhead.start(WorkerState(module, optimizer, PROGRESS))
    ahead.thread.join()
    next(module.parameters()).detach().numpy()[0] += 1.0
    with pytest.raises(TransferCorrupted):
        _send_with(module, optimizer, ahead, local)


def test_a_recovery_sends_the_digests_its_source_took_while_it_waited(hashed: list[int]) -> None:
    """In a job: the survivors of the stage that lost a replica hash their state in
    ``prepare_recovery``; the source sends those digests, and the job ends bit-identical
    to one that never failed."""
    controller, _ = make(mlp_spec(), TOP, FIRST, nodes=3)
    drive(controller)
    assert controller.phase is Phase.FINISHED, controller.error
    assert controller.events and hashed == []  # no send hashed on its own
    oracle, _ = make(mlp_spec(), TOP)
    drive(oracle)
    assert_equal_states(controller.final_states, oracle.final_states)  # type: ignore[attr-defined]


# -- what the receiver trusts before it reads (issue 33 item 8) ---------------------------


def test_an_offer_names_this_process_its_pid_namespace_and_a_proof() -> None:
    made = same_host.offer([torch.arange(10.0)])
    assert made is not None
    assert made["pid"] == os.getpid() and made["host"] == same_host.HOST
    assert made["pidns"] == os.readlink("/proc/self/ns/pid")
    address, nonce = made["proof"]
    assert address > 0 and len(bytes.fromhex(nonce)) == 16
    assert same_host.offer([torch.arange(10.0)])["proof"][1] != nonce  # type: ignore[index]


def test_an_offer_naming_another_process_falls_back_to_gloo(
    taken: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong pid -- here a fork of the sender: it maps the same addresses and holds what
    they held before the sender trained on -- used to be read into the receiver's
    weights (the digests then failed the transfer). The offer's proof is not in that
    process, so the receiver declines and the state comes over Gloo, bit-identical."""
    module, optimizer = _state(0)
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    try:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)  # the fork keeps the old values at the same addresses
        real = same_host.offer
        monkeypatch.setattr(same_host, "offer", lambda tensors: _keep(real(tensors), pid=child))
        received = _send_with(module, optimizer, None, local=True)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert taken == [False]
    _assert_same(received, (module, optimizer, 0))


def _keep(made: dict[str, Any] | None, **changes: Any) -> dict[str, Any] | None:
    """``made`` with ``changes``, still the same object (what keeps its proof alive)."""
    assert made is not None
    made.update(changes)
    return made


def test_an_offer_from_another_pid_namespace_falls_back_to_gloo(
    taken: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Containers with host networking share the host name and boot id but not pids: a
    pid from another namespace names another process here."""
    real = same_host.offer
    monkeypatch.setattr(
        same_host, "offer", lambda tensors: _keep(real(tensors), pidns="pid:[4026531999]")
    )
    received = _transfer(local=True)
    assert taken == [False]
    _assert_same(received, _transfer(local=False))


def test_an_offer_whose_proof_does_not_match_falls_back_to_gloo(
    taken: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = same_host.offer

    def forged(tensors: list[torch.Tensor]) -> dict[str, Any] | None:
        made = real(tensors)
        assert made is not None
        address, _ = made["proof"]
        return _keep(made, proof=[address, "00" * 16])

    monkeypatch.setattr(same_host, "offer", forged)
    received = _transfer(local=True)
    assert taken == [False]
    _assert_same(received, _transfer(local=False))


@pytest.mark.parametrize("code", [errno.ESRCH, errno.EFAULT])
def test_a_read_that_fails_falls_back_to_gloo(
    code: int, taken: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ESRCH or EFAULT used to fail the transfer (a communication error, retried from
    another source): the receiver declines instead, and the bytes come over Gloo."""

    def fail(*_: Any) -> int:
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(same_host, "_READV", fail)
    monkeypatch.setattr(same_host, "_refused", [])
    received = _transfer(local=True)
    assert taken == [False] and same_host.usable()  # declined once, not for good
    _assert_same(received, _transfer(local=False))
