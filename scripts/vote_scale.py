"""The commit vote at scale: the old full mesh beside the tree, measured and modelled.

    python scripts/bench.py vote --old /work/base      # or: python scripts/vote_scale.py ...

For each size (default 8, 16, 32, 64 workers) and each scheme -- the full TCP mesh of an
old checkout (``--old``: its ``parallelism/mesh.py``, loaded by path) and this tree's
`parallelism.commit_vote.CommitVote` -- it forks that many worker processes on this
machine (loopback; the TCPStore the controller would host is hosted here), forms the
vote, and runs ``--exchanges`` all-gathers of four floats each (the step's vote), after
``--warmup`` more. Between exchanges every worker waits at a barrier, so each exchange
starts with all workers arriving together; its cost is from the last worker's call to
the last worker's return (what the vote adds to a step once everyone is there). The
table gives the connections in all (counted by each worker's vote object) and the
median and 90th percentile of that cost.

Two workers are measured too (a hop with one message: the tree's two hops, the mesh's
one). A second table models both to 16,384 workers with a core each: connections exactly
(mesh ``n (n - 1) / 2``, tree ``n - 1``), and the per-step cost as hops x per-hop latency,
where a hop in which one worker handles ``m`` messages costs the two-worker hop plus
``m - 1`` messages' CPU (fitted to the mesh's medians: here its exchange costs about its
``n (n - 1)`` messages' CPU spread over the cores). The mesh is one hop with ``m = n - 1``;
the tree is ``2 * depth`` hops with ``m`` at most the fan-out. A model, stated as one: no
network latency, and not the table the tree sends down (``32 n`` bytes a link).

``--job-steps N`` (0: skip) also measures the vote where it runs: a failure-free job of
one stage x ``n`` replicas (the tests' small MLP) on the thread `WorkerGroup` -- the
controller, the workers deciding each commit, their Gloo groups, no Ray -- run by each
tree's own ``scripts/bench.py`` in a process of its own, one tree after the other. The
median and 90th percentile of its committed steps' times (from step 5 on) are what the
runtime costs per step beside a near-empty model: the control plane and the vote, old and
new side by side.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.distributed as dist

from parallelism.comm import host_store
from parallelism.commit_vote import FANOUT, CommitVote, tree_depth

TIMEOUT = datetime.timedelta(seconds=120)
ROW = [1.0, 2.5, 8.0, 0.75]
"""One worker's vote: ready, loss sum, losses, gradient norm."""
MODEL_SIZES = (8, 64, 1024, 16_384)


def load_old_mesh(tree: Path) -> ModuleType:
    """``tree``'s ``parallelism/mesh.py`` as a module of its own (it imports only the
    standard library and torch).

    Raises:
        ValueError: if ``tree`` has no ``parallelism/mesh.py``.
    """
    path = tree / "parallelism" / "mesh.py"
    if not path.is_file():
        raise ValueError(f"--old {tree}: no parallelism/mesh.py there (the full-mesh vote)")
    spec = importlib.util.spec_from_file_location("old_vote_mesh", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _worker(
    make: Any,
    index: int,
    size: int,
    port: int,
    prefix: str,
    rounds: int,
    barrier: Any,
    out: Any,
) -> None:
    """One forked worker: form the vote, then ``rounds`` exchanges, each after a barrier."""
    try:
        client = dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
        vote = make(dist.PrefixStore(prefix, client), index, size, "127.0.0.1", TIMEOUT)
        connections = len(vote._peers)
        times: list[tuple[float, float]] = []
        barrier.wait()
        for _ in range(rounds):
            barrier.wait()
            start = time.perf_counter()
            vote.allgather(ROW, TIMEOUT)
            times.append((start, time.perf_counter()))
        out.put((index, connections, times))
    except BaseException as exc:  # reported to the driver, which fails loudly
        out.put((index, -1, repr(exc)))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def measure(make: Any, size: int, exchanges: int, warmup: int, tag: str) -> dict[str, float]:
    """Connections in all and the cost of one exchange (median, p90; seconds) of ``size``
    forked workers voting with ``make``."""
    ctx = mp.get_context("fork")
    store = host_store("127.0.0.1")
    barrier = ctx.Barrier(size)
    out = ctx.Queue()
    rounds = warmup + exchanges
    procs = [
        ctx.Process(
            target=_worker,
            args=(make, i, size, store.port, f"{tag}{size}", rounds, barrier, out),
        )
        for i in range(size)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    failed = [r for r in results if r[1] < 0]
    if failed:
        raise RuntimeError(f"{tag} at {size} workers: worker {failed[0][0]} failed: {failed[0][2]}")
    times = [r[2] for r in results]
    costs = []
    for e in range(warmup, rounds):
        last_call = max(t[e][0] for t in times)
        last_return = max(t[e][1] for t in times)
        costs.append(last_return - last_call)
    costs.sort()
    return {
        "connections": sum(r[1] for r in results) / 2,
        "median": statistics.median(costs),
        "p90": costs[int(0.9 * (len(costs) - 1))],
    }


def _fit(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope through the origin of ``ys`` against ``xs``."""
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


_JOB = """
import importlib.util, json, resource, statistics, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # n threads' Gloo sockets
tree, n, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
found = importlib.util.spec_from_file_location("tree_bench", tree / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(found)
found.loader.exec_module(bench)
from parallelism import Topology
from tests.workloads import mlp_spec
times = bench._step_times(mlp_spec(), Topology(1, n), None, steps)
kept = sorted(t for s, t in times.items() if s >= 5)
print(json.dumps({"median": statistics.median(kept), "p90": kept[int(0.9 * (len(kept) - 1))]}))
"""


def measure_job(tree: Path, size: int, steps: int) -> dict[str, float]:
    """Median and 90th percentile step time of a 1 x ``size`` job on ``tree``'s runtime."""
    tree = tree.resolve()
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'scripts'}"}
    done = subprocess.run(
        [sys.executable, "-c", _JOB, str(tree), str(size), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tree} x {size}: {done.stderr[-2000:]}")
    out: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--old",
        type=Path,
        required=True,
        help="a checkout whose parallelism/mesh.py is the full-mesh vote (e.g. /work/base)",
    )
    p.add_argument("--sizes", default="8,16,32,64", help="workers, comma-separated")
    p.add_argument("--exchanges", type=int, default=200, help="measured exchanges per run")
    p.add_argument("--warmup", type=int, default=20, help="exchanges before measuring")
    p.add_argument(
        "--job-steps",
        type=int,
        default=60,
        help="steps of the 1 x n thread-group job run on each tree (0: skip it)",
    )


def run(args: argparse.Namespace) -> None:
    old = load_old_mesh(args.old)
    sizes = sorted({2, *(int(s) for s in args.sizes.split(",") if s)})  # 2: one hop
    here = Path(__file__).resolve().parents[1]
    print(
        f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the "
        f"start; old: {args.old} ({_commit(args.old)}), "
        f"new: {here} ({_commit(here)}), fan-out {FANOUT}; {args.exchanges} exchanges "
        f"after {args.warmup}, one process a worker",
        flush=True,
    )
    measured: dict[tuple[str, int], dict[str, float]] = {}
    for size in sizes:
        # Forked workers inherit the one secret, as a generation's workers get theirs.
        tree = functools.partial(CommitVote, secret=os.urandom(32))
        for name, make in (("mesh", old.Mesh), ("tree", tree)):
            measured[name, size] = measure(make, size, args.exchanges, args.warmup, name)
            print(f"  {name} x {size}: {measured[name, size]}", file=sys.stderr, flush=True)
    rows = []
    for size in sizes:
        mesh, tree = measured["mesh", size], measured["tree", size]
        rows.append(
            [
                str(size),
                f"{mesh['connections']:,.0f}",
                f"{mesh['median'] * 1e3:.2f}",
                f"{mesh['p90'] * 1e3:.2f}",
                f"{tree['connections']:,.0f}",
                str(2 * tree_depth(size)),
                f"{tree['median'] * 1e3:.2f}",
                f"{tree['p90'] * 1e3:.2f}",
            ]
        )
    print("\nmeasured: one exchange, from the last worker's call to the last worker's return\n")
    print(
        _table(
            [
                "workers",
                "mesh conns",
                "mesh median ms",
                "mesh p90 ms",
                "tree conns",
                "tree hops",
                "tree median ms",
                "tree p90 ms",
            ],
            rows,
        )
    )
    cores = os.cpu_count() or 1
    # A message's CPU: the mesh's exchange is n (n - 1) messages spread over the cores.
    per_message = _fit(
        [s * (s - 1) / cores for s in sizes], [measured["mesh", s]["median"] for s in sizes]
    )
    # A hop with one message: the tree of 2 workers is 2 hops, with a core each.
    per_hop = measured["tree", 2]["median"] / 2
    print(
        f"\nhere n workers share {cores} cores, and the mesh's exchange costs about its "
        f"n (n - 1) messages' CPU over them: {per_message * 1e6:.1f} us a message, fitted "
        "(as modelled: "
        + ", ".join(f"{s}: {s * (s - 1) / cores * per_message * 1e3:.2f} ms" for s in sizes)
        + f"); one hop with one message: {per_hop * 1e3:.3f} ms (half the tree's median at "
        f"2 workers; the mesh's at 2 workers, one hop: {measured['mesh', 2]['median'] * 1e3:.3f}"
        " ms)"
    )
    print(
        "\nmodel, a core per worker: hops x per-hop latency, a hop in which a worker handles "
        f"m messages costing {per_hop * 1e3:.3f} ms + (m - 1) x {per_message * 1e6:.1f} us. "
        "mesh: 1 hop, m = n - 1; tree: 2 x depth hops, m = the fan-out "
        f"({FANOUT}) or fewer. No network latency, and not the table the tree sends down "
        "(32 n bytes a link)\n"
    )

    def hop(messages: int) -> float:
        return per_hop + (messages - 1) * per_message

    model_rows = [
        [
            f"{n:,}",
            f"{n * (n - 1) // 2:,}",
            f"{n - 1:,}",
            f"{hop(n - 1) * 1e3:,.2f}",
            f"{n - 1:,}",
            str(_max_degree(n)),
            str(2 * tree_depth(n)),
            f"{2 * tree_depth(n) * hop(min(FANOUT, n - 1)) * 1e3:.2f}",
            f"{32 * n / 1024:,.1f}",
        ]
        for n in sorted({*sizes, *MODEL_SIZES} - {2})
    ]
    print(
        _table(
            [
                "workers",
                "mesh conns",
                "mesh conns/worker",
                "mesh model ms",
                "tree conns",
                "tree conns/worker",
                "tree hops",
                "tree model ms",
                "table KiB",
            ],
            model_rows,
        )
    )

    if args.job_steps > 0:
        job_rows = []
        for size in sorted(set(sizes) - {2}):
            got = {}
            for name, tree in (("old", args.old), ("new", here)):
                got[name] = measure_job(tree, size, args.job_steps)
                print(f"  job {name} x {size}: {got[name]}", file=sys.stderr, flush=True)
            job_rows.append(
                [
                    str(size),
                    f"{size * (size - 1) // 2:,}",
                    f"{got['old']['median'] * 1e3:.2f}",
                    f"{got['old']['p90'] * 1e3:.2f}",
                    f"{size - 1:,}",
                    f"{got['new']['median'] * 1e3:.2f}",
                    f"{got['new']['p90'] * 1e3:.2f}",
                    f"{got['new']['median'] / got['old']['median']:.2f}",
                ]
            )
        print(
            f"\nin the runtime: a 1 x n job of a small MLP on the thread WorkerGroup, "
            f"{args.job_steps} steps, step time from step 5 on (old tree, then new)\n"
        )
        print(
            _table(
                [
                    "workers",
                    "old vote conns",
                    "old median ms",
                    "old p90 ms",
                    "new vote conns",
                    "new median ms",
                    "new p90 ms",
                    "new/old",
                ],
                job_rows,
            )
        )


def _max_degree(size: int) -> int:
    """The most vote connections any one worker of ``size`` has in the tree."""
    if size <= FANOUT + 1:
        return size - 1  # the root, parent of all
    return FANOUT + 1  # worker 1: a parent and a full set of children


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
