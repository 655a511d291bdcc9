"""A chaos monkey from outside: SIGKILLs of a checkfree job's worker processes at random
wall-clock times, and the oracle at the end.

    checkfree chaos --kills 5                     # a short run (about a minute)
    checkfree chaos --kills 100 --burst-prob 0.3  # the soak (see docs/benchmarks.md)
    checkfree chaos --kills 100 --hot-spares 0 --durable-every 0 --model bn-cnn
    checkfree chaos --seconds 600 --elastic --nodes 3   # nodes removed and added back too
    checkfree chaos --throttle 3                  # a worker stopped 2/3 of the time, once

The job is the public API's: `Trainer(spec, topology=..., policy=...).fit(steps)` of a small
MLP regression (one Linear+Tanh per stage, AdamW), or with ``--model bn-cnn`` a CNN with
BatchNorm and dropout in every stage on augmented images (a model with buffers). A thread
this process runs beside it -- not the library -- reads the workers' pids from
`Trainer.live_workers()` and SIGKILLs one at Poisson times (``--mean-interval``); with
probability ``--burst-prob`` a second kill follows 0.05-0.5 s later (``--burst-gap``),
inside the recovery the first one started. With ``--nodes K`` the job runs on a
``ray.cluster_utils.Cluster`` of K nodes, and whole nodes are removed at Poisson times too
(``--node-interval``) and a fresh one added ``--node-downtime`` s later.

Segments: the script runs successive jobs of ``--steps`` steps each until ``--kills N``
kills have landed (or ``--seconds T`` have passed); every job starts from the same seed,
so each one is checked against the one uninterrupted run of ``--steps`` steps: losses and
every worker's whole final state (parameters, buffers, optimizer state, progress)
``torch.equal``. A kill lands when the process was alive to get it (one already dead, or
already killed, does not count). The monkey also follows which workers hold their
stage's state (`Trainer.holders`), so that a job lost after some stage had no live
replica left -- which only a snapshot could bring back -- is told apart from one lost
while a replica of every stage lived (a bug); ``--keep-a-replica`` never kills the last
one. It prints a line per kill and per recovery, then the totals, and exits 1 if a job
died while a replica of every stage lived, or any oracle failed, else 0. In a checkout,
``python scripts/chaos.py`` is the same program.

Throttle mode (``--throttle FACTOR``): no kills. One job of ``--steps`` steps, with
straggler replacement on (`RecoveryPolicy(stragglers=...)` at ``--straggler-factor``), in
which this process picks
the worker ``--throttle-worker`` once ``--throttle-at`` steps are committed and
duty-cycles its process with SIGSTOP/SIGCONT (`recovery.faults.Throttle`: stopped
``1 - 1/FACTOR`` of every ``--throttle-period``) until it exits. It prints the recovery
(cause ``straggler``) and the oracle, and exits 1 unless the worker was replaced as a
straggler and the job ended bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from parallelism import Topology
from recovery import Callback, FitResult, RecoveryPolicy, SnapshotPolicy, Trainer, TrainSpec
from recovery.cli.help import HelpFormatter
from recovery.cli.workloads import MODELS, spec
from recovery.faults import ChaosMonkey, KillRecord, Throttle, kill_schedule
from recovery.names import FailureCause, Strategy
from recovery.reference import differences, relative_difference

LOSS_RTOL = 1e-6
"""How close a shrunk job's losses are held to the uninterrupted run's (3+ replicas)."""
STATE_RTOL = 1e-4
"""How close its final weights and optimizer moments are held, each tensor by the norm of
its difference (`recovery.reference.relative_difference`): AdamW's division by the square
root of a second moment amplifies a last-bit difference in a gradient."""


def build_parser() -> argparse.ArgumentParser:
    """The program's flags (`parse` checks their values)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    until = p.add_mutually_exclusive_group()
    until.add_argument(
        "--kills",
        type=int,
        help="stop once this many kills have landed (default: 5 unless --seconds is given)",
    )
    until.add_argument("--seconds", type=float, help="stop starting jobs after this many seconds")
    p.add_argument(
        "--mean-interval", type=float, default=3.0, help="mean seconds between kills (Poisson)"
    )
    p.add_argument(
        "--burst-prob",
        type=float,
        default=0.3,
        help="probability that a kill is followed by a second one --burst-gap s later, inside the recovery",
    )
    p.add_argument(
        "--burst-gap",
        type=float,
        nargs=2,
        default=(0.05, 0.5),
        metavar=("LO", "HI"),
        help="a burst kill follows its kill after a gap uniform in [LO, HI] seconds",
    )
    p.add_argument("--seed", type=int, default=0, help="the job's seed and the kill schedule's")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages")
    p.add_argument("--replicas", type=int, default=3, help="data-parallel replicas")
    p.add_argument("--hot-spares", type=int, default=1, help="RecoveryPolicy(hot_spares=...)")
    p.add_argument(
        "--elastic",
        action="store_true",
        help="RecoveryPolicy(elastic=True): shrink instead of waiting for a cold replacement; "
        "with 3+ replicas a job that shrank is checked within LOSS_RTOL/STATE_RTOL",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=10,
        help="peer snapshot every this many steps (the rollback, when a stage loses every "
        "replica); 0: none",
    )
    p.add_argument(
        "--durable-every",
        type=int,
        default=20,
        help="durable snapshot every this many steps, in a temporary folder per job (the "
        "rollback when the peer copies are lost too); 0: none",
    )
    p.add_argument("--steps", type=int, default=150, help="steps per job (segment)")
    p.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="the job's model: an MLP regression (default), a CNN with BatchNorm and dropout "
        "on augmented images (buffers: the oracle checks every running statistic too), or a "
        "wider MLP (default with --throttle: a straggler shows in compute time only where "
        "there is compute to slow)",
    )
    p.add_argument(
        "--keep-a-replica",
        action="store_true",
        help="never kill the last live worker holding a stage's state: every job must then "
        "survive (without it, a job may be lost once some stage has no replica left and no "
        "snapshot brings it back, which the summary counts apart)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="run on a ray.cluster_utils.Cluster of this many nodes (>= 2; the head holds the "
        "driver and stays) and remove nodes too; 0: one local Ray node, kills only",
    )
    p.add_argument(
        "--node-interval", type=float, default=20.0, help="mean seconds between node removals"
    )
    p.add_argument(
        "--node-downtime", type=float, default=5.0, help="seconds until a node is added back"
    )
    p.add_argument(
        "--throttle",
        type=float,
        default=0.0,
        metavar="FACTOR",
        help="throttle mode: no kills; one worker slowed FACTOR times from outside by "
        "SIGSTOP/SIGCONT, with straggler replacement on (see above); 0: off",
    )
    p.add_argument(
        "--throttle-worker",
        default="1,0",
        metavar="STAGE,REPLICA",
        help="the worker throttle mode slows",
    )
    p.add_argument(
        "--throttle-at", type=int, default=30, help="throttle once this many steps are committed"
    )
    p.add_argument(
        "--straggler-factor",
        type=float,
        default=1.5,
        help="throttle mode: StragglerPolicy(factor=...) of the job; below the default 2, "
        "since a 3x duty cycle measures only ~2x in compute where workers share cores "
        "(see docs/stragglers.md)",
    )
    p.add_argument(
        "--throttle-period",
        type=float,
        default=0.005,
        help="seconds of one stop plus one run of the duty cycle (short: a stop must land "
        "inside a forward or backward pass to show in its compute time, see "
        "recovery/faults/throttle.py)",
    )
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked.

    Raises:
        SystemExit: (status 2, the message on stderr) for a value out of its range.
    """
    p = build_parser()
    args = p.parse_args(argv)
    if args.kills is None and args.seconds is None:
        args.kills = 5
    for name in ("kills", "seconds"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name} must be positive, got {value}")
    for name in ("mean_interval", "node_interval", "node_downtime"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0.0 <= args.burst_gap[0] <= args.burst_gap[1]:
        p.error(f"--burst-gap must be 0 <= LO <= HI, got {args.burst_gap}")
    if not 0.0 <= args.burst_prob <= 1.0:
        p.error(f"--burst-prob must be in [0, 1], got {args.burst_prob}")
    if args.snapshot_every < 0 or args.durable_every < 0:
        p.error("--snapshot-every and --durable-every must be >= 0")
    if args.stages < 1 or args.replicas < 1 or args.steps < 1 or args.hot_spares < 0:
        p.error("--stages, --replicas and --steps must be >= 1, --hot-spares >= 0")
    if args.nodes == 1 or args.nodes < 0:
        p.error(f"--nodes must be 0 (one local node) or >= 2, got {args.nodes}")
    if args.model is None:
        args.model = "wide-mlp" if args.throttle else "mlp"
    if args.throttle:
        try:
            stage, replica = (int(x) for x in args.throttle_worker.split(","))
        except ValueError:
            p.error(f"--throttle-worker must be STAGE,REPLICA, got {args.throttle_worker!r}")
        args.throttle_worker = (stage, replica)
        if not (0 <= stage < args.stages and 0 <= replica < args.replicas):
            p.error(
                f"--throttle-worker {args.throttle_worker} is outside {args.stages}x{args.replicas}"
            )
        if args.throttle <= 1.0 or args.throttle_period <= 0 or args.replicas < 2:
            p.error("--throttle needs FACTOR > 1, --throttle-period > 0 and --replicas >= 2")
        if args.straggler_factor <= 1.0:
            p.error(f"--straggler-factor must be > 1, got {args.straggler_factor}")
        if not 0 <= args.throttle_at < args.steps:
            p.error(f"--throttle-at must be in [0, --steps), got {args.throttle_at}")
    return args


def say(text: str) -> None:
    print(text, flush=True)


class NodeMonkey:
    """Removes a worker node of ``cluster`` at Poisson times and adds a fresh one back
    ``downtime_s`` later; never the head (the driver's node)."""

    def __init__(self, cluster: Any, seed: int, mean_s: float, downtime_s: float) -> None:
        self.cluster, self.mean_s, self.downtime_s = cluster, mean_s, downtime_s
        self.rng = random.Random(seed)
        self.removed = self.added = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-chaos", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.downtime_s + 60)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.rng.expovariate(1.0 / self.mean_s)):
            nodes = list(self.cluster.worker_nodes)
            if not nodes:
                continue
            node = self.rng.choice(nodes)
            self.cluster.remove_node(node)
            self.removed += 1
            say(f"{time.monotonic() - t0:7.2f} s  node {node.node_id[:8]} removed")
            self._stop.wait(self.downtime_s)  # added back even when stopping: the next job needs it
            added = self.cluster.add_node(num_cpus=1)
            self.added += 1
            say(f"{time.monotonic() - t0:7.2f} s  node {added.node_id[:8]} added")


def segment(
    args: argparse.Namespace,
    index: int,
    remaining: int | None,
    oracle: FitResult,
    cluster: Any,
) -> tuple[list[KillRecord], FitResult | None, list[str], NodeMonkey | None]:
    """One job under chaos: its kills, its result (None if it died) and its oracle's
    differences (or the error that ended it)."""
    top = Topology(args.stages, args.replicas)
    folder = tempfile.TemporaryDirectory(prefix="chaos-")  # fresh: nothing to resume from
    policy = RecoveryPolicy(
        hot_spares=args.hot_spares,
        elastic=args.elastic,
        snapshots=SnapshotPolicy(
            peer_every=args.snapshot_every or None,
            durable_every=args.durable_every or None,
            dir=folder.name if args.durable_every else None,
        ),
    )
    trainer = Trainer(spec(args.seed, args.model), topology=top, policy=policy)
    monkey = ChaosMonkey(
        trainer,
        kill_schedule(
            seed=args.seed * 1_000_003 + index,
            mean_interval_s=args.mean_interval,
            burst_prob=args.burst_prob,
            burst_gap_s=tuple(args.burst_gap),
        ),
        max_kills=remaining,
        on_kill=lambda record: say(f"job {index}  {record}"),
        keep_a_replica=args.keep_a_replica,
    )
    nodes = None
    if cluster is not None:
        nodes = NodeMonkey(
            cluster, args.seed * 7_919 + index, args.node_interval, args.node_downtime
        )
    monkey.start()
    if nodes is not None:
        nodes.start()
    try:
        result = trainer.fit(args.steps)
    except Exception as exc:  # a job death: any error out of fit, raw or RecoveryError
        return monkey.records, None, ["".join(traceback.format_exception(exc))], nodes
    finally:
        monkey.stop()
        if nodes is not None:
            nodes.stop()
        folder.cleanup()
    for event in result.events:
        lost = " ".join(f"({s},{r})" for s, r in event.lost)
        extra = f", {len(event.interruptions)} interruption(s)" if event.interruptions else ""
        say(
            f"job {index}  recovered step {event.step}: {event.cause} {lost} -> "
            f"{event.strategy} in {event.seconds:.2f} s{extra}"
        )
    # A shrunk job of 3+ replicas adds its shares in another order than Gloo's ring (see
    # recovery/runtime/elastic.py); one that ended shrunk has no state for its missing.
    shrank = any(Strategy.SHRINK in e.strategy for e in result.events)
    exact = _exact(args, result)
    states = {k: v for k, v in oracle.states.items() if k in result.states or not shrank}
    diffs = differences(
        result.losses, oracle.losses, where="losses", rtol=0.0 if exact else LOSS_RTOL
    )
    diffs += differences(result.states, states, where="states", rtol=0.0 if exact else STATE_RTOL)
    if not exact:
        say(f"job {index}  {_gaps(result, oracle, states)}")
    return monkey.records, result, diffs, nodes


def _gaps(result: FitResult, oracle: FitResult, states: dict[Any, Any]) -> str:
    """How far a shrunk job ended from the uninterrupted run: the largest relative difference
    of a loss, and of a final tensor (by norm, `relative_difference`)."""
    losses = max(
        (abs(a - b) / abs(b) for a, b in zip(result.losses, oracle.losses, strict=False) if b),
        default=0.0,
    )
    tensors = [
        relative_difference(a, b)
        for key in sorted(states)
        if key in result.states
        for a, b in zip(tree_leaves(result.states[key]), tree_leaves(states[key]), strict=False)
        if isinstance(b, torch.Tensor) and b.is_floating_point()
    ]
    return (
        f"largest relative difference from the uninterrupted run: losses {losses:.1e}, "
        f"final tensors {max(tensors, default=0.0):.1e}"
    )


def _exact(args: argparse.Namespace, result: FitResult) -> bool:
    """Whether ``result`` is held to the bits of the uninterrupted run: yes, unless it shrank
    with three or more replicas (see recovery/runtime/elastic.py)."""
    shrank = any(Strategy.SHRINK in e.strategy for e in result.events)
    return not shrank or args.replicas <= 2


class _StepClock(Callback):
    """When each step was committed (``time.time()``), in order."""

    def __init__(self) -> None:
        self.walls: list[float] = []

    def on_step(self, record: Any) -> None:
        self.walls.append(time.time())


def throttled_fit(
    spec: TrainSpec,
    top: Topology,
    policy: RecoveryPolicy,
    steps: int,
    *,
    worker: tuple[int, int],
    at_step: int,
    factor: float,
    period_s: float = 0.005,
) -> tuple[FitResult, Throttle, int, list[float]]:
    """Train ``steps`` steps with ``worker``'s process throttled from outside (`Throttle`)
    once ``at_step`` steps are committed, until it exits (the job replaced it; waited for
    up to a minute) or the job ends. Returns the result, the throttle, the steps committed when it began (its onset)
    and each step's commit time (``time.time()``). Ray must be connected."""
    clock = _StepClock()
    trainer = Trainer(spec, topology=top, policy=policy, callbacks=[clock])

    def pid() -> int | None:
        info = trainer.live_workers().get(worker)
        return info.pid if info is not None else None

    throttle = Throttle(
        pid, factor=factor, period_s=period_s, when=lambda: len(clock.walls) >= at_step
    ).start()
    try:
        result = trainer.fit(steps)
        if any(tuple(worker) in map(tuple, e.lost) for e in result.events):
            throttle.wait(60)  # killed: a dying Ray worker can take seconds to exit
    finally:
        throttle.stop()  # (a worker the job kept is parked for reuse: never left throttled)
    began = throttle.started_at
    onset = steps if began is None else sum(t < began for t in clock.walls)
    return result, throttle, onset, clock.walls


def throttle_mode(args: argparse.Namespace) -> int:
    """``--throttle``: one job, one worker throttled from outside; see the module docstring."""
    top = Topology(args.stages, args.replicas)
    worker = args.throttle_worker
    policy = RecoveryPolicy(
        hot_spares=args.hot_spares,
        elastic=args.elastic,
        stragglers={"factor": args.straggler_factor},
    )
    say(
        f"chaos throttle: {top} (stages x replicas), worker {worker} slowed "
        f"{args.throttle:g}x from step {args.throttle_at} (SIGSTOP/SIGCONT, "
        f"{args.throttle_period * 1000:g} ms period), {args.steps} steps, "
        f"hot_spares={args.hot_spares}"
    )
    with _local(_connect()):
        oracle = Trainer(spec(args.seed, args.model), topology=top).fit(args.steps)
        result, throttle, onset, _ = throttled_fit(
            spec(args.seed, args.model),
            top,
            policy,
            args.steps,
            worker=worker,
            at_step=args.throttle_at,
            factor=args.throttle,
            period_s=args.throttle_period,
        )
    say(
        f"throttled pid {throttle.pid} from step {onset}: {throttle.cycles} cycles, "
        + ("until it exited" if throttle.exited else "until the job ended")
    )
    for event in result.events:
        ratios = ", ".join(f"{tuple(s['worker'])} {s['ratio']:.2f}x" for s in event.stragglers)
        say(
            f"recovered step {event.step}: {event.cause} {event.lost} -> {event.strategy} "
            f"in {event.seconds:.2f} s" + (f" (compute ratio {ratios})" if ratios else "")
        )
    replaced = any(
        e.cause == FailureCause.STRAGGLER and tuple(worker) in map(tuple, e.lost)
        for e in result.events
    )
    diffs = differences(result.losses, oracle.losses, where="losses")
    diffs += differences(result.states, oracle.states, where="states")
    say(f"straggler replaced: {'yes' if replaced else 'NO'}")
    say(
        "oracle: bit-identical to the uninterrupted run"
        if not diffs
        else f"oracle: {len(diffs)} difference(s): {'; '.join(diffs[:5])}"
    )
    return 0 if replaced and not diffs else 1


def _connect() -> Any:
    from recovery.groups.ray_env import connect

    return connect


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # Token auth is Ray's default for a new local cluster: a stale ~/.ray/auth_token must
    # not decide whether the run starts.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    torch.set_num_threads(1)
    if args.throttle:
        return throttle_mode(args)
    from recovery.groups.ray_env import connect, local_cluster

    top = Topology(args.stages, args.replicas)
    until = f"{args.kills} kills" if args.kills is not None else f"{args.seconds:g} s"
    say(
        f"chaos: {top} (stages x replicas), hot_spares={args.hot_spares}, seed {args.seed}, "
        f"{args.steps} steps per job, until {until}; mean interval {args.mean_interval:g} s, "
        f"burst prob {args.burst_prob:g}"
        + (
            f"; {args.nodes} nodes, a node removed every {args.node_interval:g} s on average"
            if args.nodes
            else ""
        )
    )
    t_start = time.monotonic()
    with local_cluster(1, args.nodes - 1) if args.nodes else _local(connect) as (cluster, _):
        oracle = Trainer(spec(args.seed, args.model), topology=top).fit(args.steps)
        say(
            f"oracle: the uninterrupted run, {args.steps} steps in {oracle.wall_s:.1f} s, "
            f"final loss {oracle.losses[-1]:.6f}"
        )
        kills: list[KillRecord] = []
        strategies: collections.Counter[str] = collections.Counter()
        interrupted = interruptions = multi = survived = died = oracle_ok = oracle_bad = 0
        exhausted = 0  # jobs lost after some stage had no live replica left
        within = 0  # of oracle_ok: jobs that shrank with 3+ replicas, held within tolerance
        removed = added = idle = 0
        index = 0
        while True:
            landed = sum(k.landed for k in kills)
            if args.kills is not None and landed >= args.kills:
                break
            if args.seconds is not None and time.monotonic() - t_start >= args.seconds:
                break
            remaining = None if args.kills is None else args.kills - landed
            records, result, diffs, nodes = segment(args, index, remaining, oracle, cluster)
            kills += records
            if nodes is not None:
                removed, added = removed + nodes.removed, added + nodes.added
            wiped = sorted({s for r in records for s in r.wiped})
            if result is None and wiped:
                exhausted += 1
                say(
                    f"job {index}  lost after stage(s) {wiped} had no live replica left "
                    f"(then only a snapshot could bring them back):\n{diffs[0]}"
                )
            elif result is None:
                died += 1
                say(f"job {index}  DIED while a replica of every stage lived:\n{diffs[0]}")
            else:
                survived += 1
                for event in result.events:
                    strategies[event.strategy] += 1
                    interrupted += bool(event.interruptions)
                    multi += len(event.lost) > 1
                    interruptions += len(event.interruptions)
                if diffs:
                    oracle_bad += 1
                    say(
                        f"job {index}  ORACLE FAILED: {len(diffs)} difference(s): {'; '.join(diffs[:5])}"
                    )
                else:
                    oracle_ok += 1
                    within += not _exact(args, result)
                    say(
                        f"job {index}  finished in {result.wall_s:.1f} s "
                        f"({len(result.events)} recoveries), "
                        + (
                            "bit-identical to the uninterrupted run"
                            if _exact(args, result)
                            else f"within rtol {LOSS_RTOL:g} (losses) / {STATE_RTOL:g} (states) "
                            "of the uninterrupted run (it shrank)"
                        )
                    )
            idle = 0 if any(r.landed for r in records) else idle + 1
            if idle >= 3:
                say("3 jobs in a row took no kill: raise --steps or lower --mean-interval")
                died += 1  # not a death of the job, but the run proved nothing: fail it
                break
            index += 1
    wall = time.monotonic() - t_start
    landed_bursts = sum(k.landed and k.burst for k in kills)
    by_strategy = ", ".join(f"{name} {n}" for name, n in strategies.most_common()) or "none"
    say("")
    say(
        f"kills: {len(kills)} attempted, {sum(k.landed for k in kills)} landed ({landed_bursts} of them bursts)"
    )
    if args.nodes:
        say(f"nodes: {removed} removed, {added} added back")
    say(
        f"recoveries: {sum(strategies.values())} ({by_strategy}); "
        f"{multi} with 2+ workers lost, {interrupted} interrupted by a further failure "
        f"({interruptions} interruptions)"
    )
    say(
        f"jobs: {survived} survived, {died} died while a replica of every stage lived, "
        f"{exhausted} lost after some stage had no live replica left"
    )
    say(
        f"oracle: {oracle_ok - within} of {survived + died + exhausted} jobs bit-identical to "
        f"the uninterrupted run (losses and final model -- parameters and buffers -- optimizer "
        f"state and progress, torch.equal)"
        + (
            f", {within} that shrank within rtol {LOSS_RTOL:g} (losses) / {STATE_RTOL:g} "
            f"(final tensors, by norm)"
            if within
            else ""
        )
        + (f"; {oracle_bad} differ" if oracle_bad else "")
    )
    say(f"wall: {wall:.0f} s")
    return 1 if died or oracle_bad else 0


class _local:
    """A local Ray on 127.0.0.1 (`recovery.groups.ray_env.connect`), as a context manager
    that yields no cluster."""

    def __init__(self, connect: Any) -> None:
        self.connect = connect

    def __enter__(self) -> tuple[None, list[Any]]:
        self.connect()
        return None, []

    def __exit__(self, *exc: object) -> None:
        import ray

        from recovery.groups.pool import POOL

        POOL.clear()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
