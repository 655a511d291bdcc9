"""The data-parallel step without the runtime: checkfree's `StageEngine` against DDP.

    python scripts/engine_vs_ddp.py [--size 10] [--steps 300] [--rounds 3] [--no-votes]
    checkfree engine-vs-ddp --size 10 --rounds 1

Two processes over Gloo on loopback, the workload of ``bench.py peers`` (4 x
``Linear(w, w)`` + ReLU, AdamW, batch 8, MSE, one torch thread each), failure-free: per
step, either one ``StageEngine.run`` (bucketed all-reduce overlapped with backward,
gradient norm) and ``optimizer.step()``, or ``DistributedDataParallel`` forward/backward
and ``optimizer.step()``. No controller, no Ray: what is left between this and
``bench.py peers`` is the runtime's share. Two more rows add the workers' commit vote
between the two, as the runtime sends it ([Note: the vote's own connections] in
parallelism/commit_vote.py: `StageComm.exchange`) and as it was sent before, an all-gather over
a Gloo group (``--no-votes`` leaves both out). Both keep their freed memory, as a
checkfree worker does ([Note: a worker keeps its freed memory]). The two take turns,
``--rounds`` times; each prints rank 0's median step and CPU seconds per step (after 3
warm-up steps), and the final weights' sum (the same for both: the same bits). It loads
scripts/peers.py, so it stays a file of scripts/ (``checkfree engine-vs-ddp`` runs it from
the checkout).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs without the install

from recovery.cli.help import HelpFormatter
from recovery.worker.memory import keep_freed_memory


def _peers():  # type: ignore[no-untyped-def]
    """scripts/peers.py (the workload of ``bench.py peers``), loaded by its path."""
    path = Path(__file__).resolve().with_name("peers.py")
    spec = importlib.util.spec_from_file_location("_checkfree_script_peers", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


peers = _peers()

WARMUP = 3


def _worker(
    rank: int, mode: str, width: int, steps: int, port: int, secret: bytes, out: mp.Queue
) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()
    torch.manual_seed(0)
    model = peers.build_model(width)
    optimizer = peers._optimizer(model.parameters())
    wall: list[float] = []
    cpu: list[float] = []
    if mode == "ddp":
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        ddp = torch.nn.parallel.DistributedDataParallel(model)

        def step(s: int) -> None:
            optimizer.zero_grad()
            x, y = peers.batch(s, rank, width)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
    else:
        from parallelism import Topology
        from parallelism.comm import Rendezvous, StageComm
        from parallelism.engine import StageEngine
        from parallelism.schedule import build_schedule

        top = Topology(1, 2)
        rendezvous = Rendezvous("127.0.0.1", port, "g0", 60, secret=secret)
        comm = StageComm(rendezvous, top, rank, "gloo", "127.0.0.1")
        engine = StageEngine(
            model, stage=0, replica=rank, topology=top,
            loss_fn=torch.nn.functional.mse_loss, device=torch.device("cpu"),
        )  # fmt: skip
        schedule = build_schedule("1f1b", 1, 1)

        def vote(stats: object) -> None:
            row = [1.0, stats.loss_sum, float(stats.losses), stats.clipped_grad_norm]  # type: ignore[attr-defined]
            if mode == "vote-tcp":
                comm.exchange(row)
            elif mode == "vote-gloo":
                mine = torch.tensor(row, dtype=torch.float64)
                rows = [torch.empty_like(mine) for _ in range(2)]
                comm.wait(comm.world.allgather([rows], [mine]))

        def step(s: int) -> None:
            x, y = peers.batch(s, rank, width)
            vote(engine.run(schedule, comm, [x], [y]))
            optimizer.step()
            model.zero_grad(set_to_none=True)

    for s in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step(s)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    total = float(sum(p.detach().double().sum() for p in model.parameters()))
    if rank == 0:
        out.put((statistics.median(wall[WARMUP:]), statistics.median(cpu[WARMUP:]), total))
    out.close()
    out.join_thread()  # the result is sent; then leave without tearing torch's threads down
    os._exit(0)


def _run(mode: str, width: int, steps: int) -> tuple[float, float, float]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    store = None
    if mode == "ddp":
        port = peers.free_port()
    else:  # the engine's groups form on a store the caller hosts, as the controller does
        from parallelism.comm import host_store

        store = host_store("127.0.0.1")
        port = store.port
    secret = os.urandom(32)  # one generation: the same secret for both workers
    procs = [
        ctx.Process(target=_worker, args=(r, mode, width, steps, port, secret, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    while out.empty():
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError(f"a {mode} worker failed (its traceback is above)")
        time.sleep(0.1)
    got = out.get()
    for p in procs:
        p.join(timeout=60)
    del store
    return got  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument(
        "--size", type=int, default=10, choices=sorted(peers.WIDTHS), help="parameter MB"
    )
    ap.add_argument("--steps", type=int, default=300, help="steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, taking turns")
    ap.add_argument(
        "--no-votes", action="store_true", help="leave out the two rows with a commit vote"
    )
    args = ap.parse_args(argv)
    width = peers.WIDTHS[args.size]
    print(f"{args.size} MB (w={width}), {args.steps} steps a run, medians after {WARMUP}")
    modes = {"DDP": "ddp", "StageEngine": "engine"}
    if not args.no_votes:
        modes |= {"+ vote, TCP": "vote-tcp", "+ vote, Gloo": "vote-gloo"}
    ratios: dict[str, list[float]] = {name: [] for name in modes if name != "DDP"}
    for r in range(args.rounds):
        got = {name: _run(mode, width, args.steps) for name, mode in modes.items()}
        for name, (wall, cpu, total) in got.items():
            if name != "DDP":
                ratios[name].append(wall / got["DDP"][0])
            print(
                f"round {r + 1} {name:12s} step {wall * 1e3:6.1f} ms  cpu {cpu * 1e3:6.1f} ms"
                f"  weights' sum {total:.6f}",
                flush=True,
            )
    for name, values in ratios.items():
        print(f"{name} / DDP per round: " + ", ".join(f"{x:.3f}" for x in values))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
