"""`StageComm` waits: slow peers are waited for, closed groups are given up on."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from parallelism import Topology
from parallelism.comm import Rendezvous, StageComm, host_store


def _pair(top: Topology) -> list[StageComm]:
    store = host_store("127.0.0.1")
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 20)
    with ThreadPoolExecutor(top.world_size) as pool:
        futures = [
            pool.submit(StageComm, rdzv, top, r, "gloo", "127.0.0.1") for r in range(top.world_size)
        ]
        comms = [f.result(timeout=30) for f in futures]
    comms[0].keep = store  # type: ignore[attr-defined]  # the store lives as long as the groups
    return comms


def test_a_receive_waits_for_a_slow_sender_and_a_collective_for_a_slow_peer() -> None:
    """Waits longer than the 100 ms slices a collective is waited in still succeed:
    a pipeline receive (stage 0 -> 1) and a stage all-reduce (replica 0 and 1)."""
    recv_comms = _pair(Topology(2, 1))
    reduce_comms = _pair(Topology(1, 2))

    def slow_send() -> None:
        time.sleep(0.4)
        recv_comms[0].send_activation(torch.arange(6.0).reshape(2, 3), 1)
        recv_comms[0].wait_sends()

    def slow_reduce() -> None:
        time.sleep(0.4)
        work = reduce_comms[1].allreduce_stage(torch.ones(4))
        assert work is not None
        reduce_comms[1].wait(work)

    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(slow_send)
        got = recv_comms[1].recv_activation(0)
        sent.result(timeout=10)
        peer = pool.submit(slow_reduce)
        mine = torch.ones(4)
        work = reduce_comms[0].allreduce_stage(mine)
        assert work is not None
        reduce_comms[0].wait(work)
        peer.result(timeout=10)
    assert torch.equal(got, torch.arange(6.0).reshape(2, 3))
    assert torch.equal(mine, torch.full((4,), 2.0))
    for comm in recv_comms + reduce_comms:
        comm.close()
