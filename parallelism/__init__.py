"""How training is laid out and run across workers. Knows nothing of failures."""

from parallelism.topology import Topology, Worker

__all__ = ["Topology", "Worker"]
