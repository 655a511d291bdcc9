"""Connecting to Ray: the cluster in ``RAY_ADDRESS`` (a ``ray job submit`` run) or a local one.

A local Ray is started bound to 127.0.0.1 with the dashboard off, so a training run on a
laptop or a CI machine opens nothing to the network.
"""

from __future__ import annotations

import logging
import os

import ray


def connect(*, num_cpus: int | None = None, log_to_driver: bool = False) -> bool:
    """Make sure this process is connected to Ray. Returns True if it started a local Ray.

    With ``RAY_ADDRESS`` set (as ``ray job submit`` does), connects to that cluster;
    otherwise starts a local single-node Ray on 127.0.0.1.
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=log_to_driver, logging_level=logging.WARNING)
        return False
    ray.init(
        num_cpus=num_cpus or os.cpu_count() or 1,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=log_to_driver,
        logging_level=logging.WARNING,
        configure_logging=True,
    )
    return True


def driver_host() -> str:
    """The address workers use to reach this (the controller's) process."""
    try:
        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"


def alive_nodes() -> list[str]:
    """Node ids of the alive Ray nodes."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
