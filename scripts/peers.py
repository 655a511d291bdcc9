"""checkfree beside its peers on one data-parallel workload, one after another in one run.

    python scripts/bench.py peers [--sizes 10,100] [--repeats 3]

The workload is the one of a standard peer harness: 1 stage x 2 replicas, 4 x
``Linear(w, w)`` with ReLU, AdamW(lr 1e-4), batches of 8 random inputs and targets, MSE,
one torch thread per process; replica 1 is SIGKILLed in the middle of a step after
``KILL_AFTER`` committed steps. The systems take turns, one run each per round, so that a
slower minute of the machine falls on all of them alike. Per system, per size, per
repetition it measures the steady step (median wall time between consecutive committed
steps before the kill, after warm-up; every system's the same way) and the time from the
kill until both replicas have committed a step again:

- **torchrun + DDP** (Gloo): ``torch.distributed.run`` with restarts; rank 0 writes
  ``torch.save`` every 10 steps and a restart loads it (the steps since are redone). Each
  restart's workers form their group on a store of their own (torchrun's shared store
  fails often on Gloo restarts).
- **torchft** 0.2.0 (an optional extra: ``pip install -e ".[peers]"``): one replica group
  per replica, its lighthouse on 127.0.0.1 with a 1 s heartbeat timeout,
  ``Manager.allreduce`` per gradient (``torchft.ddp.PureDistributedDataParallel``: its
  ``DistributedDataParallel`` fails an assertion in its comm hook on this torch) and
  ``torchft.Optimizer``; the killed replica is
  started again at once (a scheduler with room) and heals from the survivor.
- **checkfree** (``TrainSpec`` callbacks, ``Topology(1, 2)``, on Ray): the kill comes from
  the library's ``FailureSchedule`` (``KillPoint.MID_PIPELINE``, a real SIGKILL), with a
  cold replacement and with a warm spare; the time is the recovery event's
  (detect + replace + reform + transfer + resume to the first commit).

A second table splits checkfree's recoveries into their phases and sets the state
transfer's rate beside one libc ``memcpy`` of the same bytes (one call, one thread),
measured in this process right after each run.

torchft's manager and torch's TCPStore listen on every interface: with ``--isolate`` (the
default when this runs as root and ``unshare`` exists) everything runs in a private
network namespace with only ``lo`` up; otherwise the output says it was not isolated.
Every figure is measured by this run; nothing is copied from elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import itertools
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

KILL_AFTER = 15
"""Committed steps before replica 1 is killed."""
AFTER_KILL = 6
"""Steps each replica trains after the kill (so both are seen training again)."""
WARMUP = 3
BATCH = 8
WIDTHS = {10: 809, 100: 2560}
"""Parameter megabytes -> width w of the four Linear(w, w) layers (4 w^2 + 4 w floats)."""


# ----------------------------------------------------------------------------- workload


def build_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def batch(step: int, replica: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)


def _optimizer(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=1e-4)


class StepLog:
    """One line per committed step, ``step wall_time``, flushed at once (read by the driver)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def committed(self, step: int) -> None:
        self.file.write(f"{step} {time.time():.6f}\n")
        self.file.flush()


def read_log(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((int(parts[0]), float(parts[1])))
    return rows


# ------------------------------------------------------------------------------ workers


def ddp_worker(out: Path, width: int, steps: int, port: int) -> None:
    """One torchrun rank: DDP over Gloo on a store of this restart's own."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    (out / f"ddp-{rank}.pid").write_text(str(os.getpid()))
    store = dist.TCPStore(
        "127.0.0.1", port + restart, world, rank == 0, datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(build_model(width))
    optimizer = _optimizer(model.parameters())
    start, ckpt = 0, out / "ddp.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = int(saved["step"])
    log = StepLog(out / f"ddp-{rank}.log")
    for step in range(start, steps):
        x, y = batch(step, rank, width)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if rank == 0 and (step + 1) % 10 == 0:
            tmp = out / "ddp.pt.tmp"
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
        log.committed(step)
    dist.destroy_process_group()


def ft_worker(out: Path, width: int, steps: int, replica: int, store_port: int) -> None:
    """One torchft replica group of one process."""
    import torch.distributed as dist
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.ddp import PureDistributedDataParallel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, 1, True, datetime.timedelta(seconds=60))
    net = build_model(width)
    inner = _optimizer(net.parameters())

    def state_dict() -> dict[str, object]:
        return {"model": net.state_dict(), "optimizer": inner.state_dict()}

    def load_state_dict(state: dict[str, object]) -> None:
        net.load_state_dict(state["model"])  # type: ignore[arg-type]
        inner.load_state_dict(state["optimizer"])  # type: ignore[arg-type]

    manager = Manager(
        pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"peers-{replica}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        timeout=datetime.timedelta(seconds=10),
    )
    model = PureDistributedDataParallel(manager, net)
    optimizer = Optimizer(manager, inner)
    (out / f"ft-{replica}.pid").write_text(str(os.getpid()))  # heartbeating from here
    while not (out / "go").exists():  # both in the first quorum (later starts heal)
        time.sleep(0.01)
    log = StepLog(out / f"ft-{replica}.log")
    while manager.current_step() < steps:
        step = manager.current_step()
        optimizer.zero_grad()
        x, y = batch(step, replica, width)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if manager.current_step() > step:
            log.committed(step)
    manager.shutdown(wait=False)
    del store


# ------------------------------------------------------------------------------ driver


@dataclass
class Row:
    system: str
    size_mb: int
    steady: list[float] = field(default_factory=list)
    back: list[float] = field(default_factory=list)
    note: str = ""
    events: list[Any] = field(default_factory=list)
    """checkfree: each run's recovery event."""
    memcpy: list[float] = field(default_factory=list)
    """checkfree: per event, seconds of a memcpy of its bytes, measured right after it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _steady(log: list[tuple[int, float]]) -> float:
    """Median seconds between consecutive committed steps before the kill, after warm-up."""
    first: list[tuple[int, float]] = []
    for step, t in log:  # until a restart goes back to its checkpoint
        if first and step <= first[-1][0]:
            break
        first.append((step, t))
    times = [t for step, t in first if step < KILL_AFTER]
    gaps = [b - a for a, b in itertools.pairwise(times)][WARMUP:]
    return statistics.median(gaps)


def _wait_for(what: str, ok: Callable[[], bool], timeout: float, proc=None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not ok():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.01)


def _kill_mid_step(pid_file: Path, logs: list[Path], step_s: float) -> float:
    """SIGKILL the process in ``pid_file`` half a step after both replicas committed
    ``KILL_AFTER`` steps; returns the wall time of the kill."""
    _wait_for(
        "steps before the kill",
        lambda: all(any(s >= KILL_AFTER - 1 for s, _ in read_log(p)) for p in logs),
        600,
    )
    time.sleep(step_s / 2)
    killed_at = time.time()
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    return killed_at


def _back(logs: list[Path], killed_at: float, timeout: float) -> float:
    """Seconds from the kill until every replica has logged a committed step after it."""

    def first_after(p: Path) -> float | None:
        return next((t for _, t in read_log(p) if t > killed_at), None)

    _wait_for("training again after the kill", lambda: all(first_after(p) for p in logs), timeout)
    return max(first_after(p) or 0.0 for p in logs) - killed_at


def run_torchrun(width: int, out: Path) -> tuple[float, float]:
    steps = KILL_AFTER + AFTER_KILL
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        __file__, "--worker", "ddp", "--out", str(out), "--width", str(width),
        "--steps", str(steps), "--port", str(port),
    ]  # fmt: skip
    logs = [out / f"ddp-{r}.log" for r in range(2)]
    with _process(cmd, out / "torchrun.out") as proc:
        _wait_for("first steps", lambda: len(read_log(logs[0])) > WARMUP + 1, 300, proc)
        probe = read_log(logs[0])
        killed = _kill_mid_step(out / "ddp-1.pid", logs, probe[-1][1] - probe[-2][1])
        back = _back(logs, killed, 300)
        proc.wait(timeout=600)
    return _steady(read_log(logs[0])), back


def run_torchft(width: int, out: Path) -> tuple[float, float]:
    binary = shutil.which("torchft_lighthouse") or str(
        Path(sys.executable).with_name("torchft_lighthouse")
    )
    light = free_port()
    steps = KILL_AFTER + AFTER_KILL
    lighthouse = [
        binary, "--bind", f"127.0.0.1:{light}", "--min_replicas", "1",
        "--heartbeat_timeout_ms", "1000",
    ]  # fmt: skip
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{light}"}

    def replica(r: int) -> list[str]:
        return [
            sys.executable, __file__, "--worker", "ft", "--out", str(out), "--width",
            str(width), "--steps", str(steps), "--replica", str(r), "--port", str(free_port()),
        ]  # fmt: skip

    logs = [out / f"ft-{r}.log" for r in range(2)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_process(lighthouse, out / "lighthouse.out", env))
        time.sleep(0.5)
        first = stack.enter_context(_process(replica(0), out / "ft-0.out", env))
        stack.enter_context(_process(replica(1), out / "ft-1.out", env))
        pids = [out / f"ft-{r}.pid" for r in range(2)]
        _wait_for("torchft managers", lambda: all(p.exists() for p in pids), 60, first)
        time.sleep(0.5)  # a few heartbeats: the lighthouse sees both before the first quorum
        (out / "go").touch()
        _wait_for("first steps", lambda: len(read_log(logs[0])) > WARMUP + 1, 300, first)
        if read_log(logs[0])[0][0] != read_log(logs[1])[0][0]:
            raise RuntimeError("the replicas did not start in one quorum")
        probe = read_log(logs[0])
        killed = _kill_mid_step(out / "ft-1.pid", logs, probe[-1][1] - probe[-2][1])
        stack.enter_context(_process(replica(1), out / "ft-1b.out", env))  # started again
        back = _back(logs, killed, 300)
        first.wait(timeout=600)
    return _steady(read_log(logs[0])), back


@contextlib.contextmanager
def _process(cmd: list[str], output: Path, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    with output.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_checkfree(width: int, spares: int, out: Path) -> tuple[float, float]:
    from parallelism import Topology
    from recovery import (
        FailureSchedule,
        Kill,
        KillPoint,
        RecoveryPolicy,
        SnapshotPolicy,
        Trainer,
        TrainSpec,
    )
    from recovery.groups.pool import POOL

    # Fresh worker processes, as the peers' runs have: not ones parked by the run before,
    # which a recovery may have started (see [Note: huge pages for a worker's heap]).
    POOL.clear()

    spec = TrainSpec(
        build_stage=lambda stage, num_stages: build_model(width),
        loss_fn=torch.nn.functional.mse_loss,
        make_optimizer=_optimizer,
        batches=lambda step, replica, num_replicas: batch(step, replica, width),
        microbatches=1,
        name=f"peers-w{width}",
    )
    kill = Kill(step=KILL_AFTER, stage=0, replica=1, at=KillPoint.MID_PIPELINE)
    result = Trainer(
        spec,
        topology=Topology(1, 2),
        policy=RecoveryPolicy(hot_spares=spares, snapshots=SnapshotPolicy(peer_every=None)),
        failures=FailureSchedule([kill]),
        collect_states=False,
    ).fit(KILL_AFTER + AFTER_KILL)
    # Wall time between committed steps, as the peers' step logs measure it.
    commits = [(m["step"], m["time"]) for m in result.metrics]
    (event,) = result.events
    RECOVERIES.append(event)
    return _steady(commits), event.seconds


RECOVERIES: list[object] = []
"""The recovery events of the checkfree runs (`run_checkfree`), for the transfer table."""


def memcpy_seconds(nbytes: int) -> float:
    """Seconds of one libc ``memcpy`` of ``nbytes`` into memory already touched (best of 5).

    One call on one thread: the reference a transfer's rate is put against. (A tensor's
    ``copy_`` splits a large copy over torch's intra-op threads, and what that gives
    depends on how many the calling process has and what else runs on the cores.)
    """
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    memcpy = ctypes.CDLL(None).memcpy
    memcpy.restype = ctypes.c_void_p
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        memcpy(dst.data_ptr(), src.data_ptr(), nbytes)
        best = min(best, time.perf_counter() - start)
    return best


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.3f} ({min(values):.3f}-{max(values):.3f})"


def bench(sizes: list[int], repeats: int, isolated: bool) -> None:
    have_ft = (
        shutil.which("torchft_lighthouse") is not None
        or Path(sys.executable).with_name("torchft_lighthouse").exists()
    )
    try:
        import torchft  # noqa: F401
    except ImportError:
        have_ft = False
    rows: list[Row] = []
    for size in sizes:
        width = WIDTHS.get(size) or int(((size * 2**20 / 4) / 4) ** 0.5)
        systems: dict[str, Callable[[Path], tuple[float, float]] | None] = {
            "torchrun + DDP, restart + torch.save/10 steps": partial(run_torchrun, width),
            "torchft 0.2.0, heartbeat timeout 1 s": partial(run_torchft, width)
            if have_ft
            else None,
            "checkfree, cold replacement": partial(run_checkfree, width, 0),
            "checkfree, warm spare": partial(run_checkfree, width, 1),
        }
        sized = [Row(name, size) for name in systems]
        rows.extend(sized)
        for row in sized:
            if systems[row.system] is None:
                row.note = 'not installed: pip install -e ".[peers]"'
        # Round-robin, one run of every system per round: the machine's slower and faster
        # minutes fall on all of them alike.
        for rep in range(repeats):
            for row in sized:
                fn = systems[row.system]
                if fn is None:
                    continue
                name = row.system
                print(f"[{size} MB] {name}: run {rep + 1}/{repeats}", file=sys.stderr, flush=True)
                RECOVERIES.clear()
                with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
                    try:
                        steady, back = fn(Path(tmp))
                    except (RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
                        row.note = f"failed: {exc}"
                        print(f"  failed: {exc}", file=sys.stderr)
                        continue
                row.steady.append(steady)
                row.back.append(back)
                row.events.extend(RECOVERIES)
                for event in RECOVERIES:  # the same bytes copied here, right after
                    row.memcpy.append(memcpy_seconds(event.bytes_moved))  # type: ignore[attr-defined]
    print(
        f"\nPeers, 1 stage x 2 replicas, 4 x Linear(w, w) + ReLU, AdamW, batch {BATCH}, MSE; "
        f"replica 1 SIGKILLed mid-step after {KILL_AFTER} steps; medians of {repeats} "
        f"(min-max), seconds. Network: {'private namespace, lo only' if isolated else 'NOT isolated (run as root with unshare for a private namespace)'}."
    )
    header = (
        "| size | system | steady step | x checkfree | kill -> both training | x checkfree warm |"
    )
    print(header)
    print("|" + "---|" * 6)
    for size in sizes:
        mine = next(
            r for r in rows if r.size_mb == size and r.system == "checkfree, cold replacement"
        )
        warm = next(r for r in rows if r.size_mb == size and r.system == "checkfree, warm spare")
        for r in (x for x in rows if x.size_mb == size):
            ratio = (
                f"{statistics.median(r.steady) / statistics.median(mine.steady):.2f}"
                if r.steady and mine.steady
                else "-"
            )
            back = (
                f"{statistics.median(r.back) / statistics.median(warm.back):.2f}"
                if r.back and warm.back
                else "-"
            )
            print(
                f"| {size} MB | {r.system} | {_fmt(r.steady)} | {ratio} | {_fmt(r.back)} | {back} |"
                + (f" {r.note}" if r.note else "")
            )
    _recovery_table(rows)


def _recovery_table(rows: list[Row]) -> None:
    """checkfree's recoveries, phase by phase, and the state transfer against a memcpy of
    the same bytes on this machine (measured right after each run)."""
    mine = [r for r in rows if r.events]
    if not mine:
        return
    print(
        "\ncheckfree recoveries: phases (medians, s); transfer rate against one memcpy call "
        "(one thread) of the same bytes, both measured in this run."
    )
    print(
        "| size | system | detect | replace | reform | transfer | resume | state MB "
        "| transfer GB/s | memcpy GB/s | of memcpy |"
    )
    print("|" + "---|" * 11)
    for r in mine:
        phases = [
            statistics.median(e.breakdown[p] for e in r.events)
            for p in ("detect", "replace", "reform", "transfer", "resume")
        ]
        nbytes = statistics.median(e.bytes_moved for e in r.events)
        rates = [e.bytes_moved / e.breakdown["transfer"] for e in r.events]
        copies = [e.bytes_moved / m for e, m in zip(r.events, r.memcpy, strict=True)]
        shares = [a / b for a, b in zip(rates, copies, strict=True)]
        print(
            f"| {r.size_mb} MB | {r.system} | "
            + " | ".join(f"{x:.3f}" for x in phases)
            + f" | {nbytes / 1e6:.0f} | {statistics.median(rates) / 1e9:.2f} "
            f"| {statistics.median(copies) / 1e9:.2f} | {100 * statistics.median(shares):.0f}% "
            f"({100 * min(shares):.0f}-{100 * max(shares):.0f}%) |"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="10,100", help="parameter megabytes, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="runs per system and size")
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="do not re-run inside a private network namespace (unshare --net)",
    )


def run(args: argparse.Namespace) -> None:
    """`bench.py peers`: re-runs itself in a private network namespace when it can."""
    sizes = [int(s) for s in args.sizes.split(",") if s]
    inside = os.environ.get("CHECKFREE_PEERS_ISOLATED") == "1"
    can = os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip")
    if not inside and not args.no_isolate and can:
        argv = [sys.executable, __file__, "--sizes", args.sizes, "--repeats", str(args.repeats)]
        shell = "ip link set lo up && exec " + " ".join(argv)
        env = {**os.environ, "CHECKFREE_PEERS_ISOLATED": "1"}
        subprocess.run(["unshare", "--net", "sh", "-c", shell], check=True, env=env)
        return
    bench(sizes, args.repeats, isolated=inside)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", choices=["ddp", "ft"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.worker == "ddp":
        ddp_worker(args.out, args.width, args.steps, args.port)
    elif args.worker == "ft":
        ft_worker(args.out, args.width, args.steps, args.replica, args.port)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
