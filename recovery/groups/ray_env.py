"""Connecting to Ray: the cluster in ``RAY_ADDRESS`` (a ``ray job submit`` run) or a local one.

[Note: loopback only]
A local Ray is started bound to 127.0.0.1 with the dashboard off, so a training run on a
laptop or a CI machine opens nothing to the network. ``ray.init(_node_ip_address=
"127.0.0.1")`` alone does not do it: Ray on Linux swaps a loopback node address for the
machine's routable IP, and its servers then listen on every interface. Ray keeps to
loopback when its "cluster mode" is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the
setting it uses on laptops), so that is set -- in the environment, for the processes Ray
spawns, and in Ray's already-imported constants, for this one -- before a local start.
Connecting to an existing cluster changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import ray

from recovery.faults.exits import EXPECTED_EXITS


def connect(*, num_cpus: int | None = None, log_to_driver: bool = False) -> bool:
    """Make sure this process is connected to Ray. Returns True if it started a local Ray.

    With ``RAY_ADDRESS`` set (as ``ray job submit`` does), connects to that cluster;
    otherwise starts a local single-node Ray on 127.0.0.1.
    """
    if ray.is_initialized():
        return False
    _quiet_expected_deaths()
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=log_to_driver, logging_level=logging.WARNING)
        return False
    _loopback_only()
    # Token authentication stays on; its notice is for clusters others connect to, not a
    # loopback-only Ray this process starts and stops.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
        logging.ERROR
    )
    ray.init(
        address="local",  # a new local Ray, never some other process's cluster on this machine
        num_cpus=num_cpus or os.cpu_count() or 1,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=log_to_driver,
        logging_level=logging.WARNING,
        configure_logging=True,
    )
    return True


@contextlib.contextmanager
def local_cluster(
    cpus_per_node: int, worker_nodes: int = 2, head_cpus: int | None = None
) -> Iterator[tuple[Any, list[Any]]]:
    """A multi-node ``ray.cluster_utils.Cluster`` on loopback -- a head (``head_cpus``
    CPUs, default ``cpus_per_node``) and ``worker_nodes`` nodes of ``cpus_per_node`` CPUs
    each, every one a real raylet that can be removed (``cluster.remove_node``) and added --
    with this process connected to it; yields the cluster and its worker nodes and tears
    everything down after. A Ray this process was already connected to is shut down first.
    For tests and scripts/chaos.py."""
    from ray.cluster_utils import Cluster

    from recovery.groups.pool import POOL

    if ray.is_initialized():
        POOL.clear()
        ray.shutdown()
    _loopback_only()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": cpus_per_node if head_cpus is None else head_cpus},
    )
    try:
        workers = [cluster.add_node(num_cpus=cpus_per_node) for _ in range(worker_nodes)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster, workers
    finally:
        POOL.clear()
        ray.shutdown()
        cluster.shutdown()


def _loopback_only() -> None:
    """See [Note: loopback only]."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # a Ray without the switch: nothing to turn off
        pass


def node_addresses() -> dict[str, str]:
    """Node id -> the IP address Ray knows the node by (what its workers bind to)."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


def driver_host() -> str:
    """The address workers use to reach this (the controller's) process."""
    try:
        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"


def alive_nodes() -> list[str]:
    """Node ids of the alive Ray nodes."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


# -- deaths the job expected -------------------------------------------------------------

_DIED = re.compile(r"A worker died or was killed while executing a task.*Worker PID: (\d+)", re.S)


def _quiet_expected_deaths() -> None:
    """Leave out Ray's paragraph about an unexpected worker death for the deaths the job
    chose (`recovery.faults.exits.expect_exit`; the controller logs a line of its own);
    Ray's text stays for every other death. Filters Ray's driver-side error printer (`ray._private.worker.print_to_stdstream`,
    which its error listener looks up at each call) once per process."""
    from ray._private import worker

    original = worker.print_to_stdstream
    if getattr(original, "_checkfree", False):
        return

    def print_to_stdstream(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            lines = [line for line in data.get("lines", []) if not _expected(line)]
            if not lines:
                return
            data = {**data, "lines": lines}
        original(data, ignore_prefix)

    print_to_stdstream._checkfree = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = print_to_stdstream


def _expected(line: str) -> bool:
    found = _DIED.search(line)
    return found is not None and int(found.group(1)) in EXPECTED_EXITS
