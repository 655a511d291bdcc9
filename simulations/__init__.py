"""Simulations: convergence under failures (in-process) and cluster-scale failure simulation.

This package re-exports the cluster simulator (numpy only: ``traces``, ``costs``,
``layout``, ``analytics``, ``policy_models``, ``classify``, ``results``, ``cluster``) and
the names of simulated policies (``policies``). The convergence and embedding studies
(``simulations.convergence``, ``simulations.embedding``) need torch, so they are imported
from their modules, not from here.

The names below are imported on first use (PEP 562), so that ``import simulations.cli``
-- the ``checkfree`` command's dispatcher -- loads neither the simulator nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES: dict[str, str] = {
    "ActionKind": "simulations.cluster",
    "CAUSES": "simulations.cluster",
    "COMPONENTS": "simulations.traces",
    "CheckFree": "simulations.cluster",
    "CheckFreePlus": "simulations.cluster",
    "CheckpointRestart": "simulations.cluster",
    "ClusterShape": "simulations.traces",
    "CostModel": "simulations.costs",
    "EmbeddingPartial": "simulations.cluster",
    "EventFacts": "simulations.cluster",
    "EventLog": "simulations.cluster",
    "ExponentialFailures": "simulations.traces",
    "FailureEvents": "simulations.traces",
    "FailureModel": "simulations.traces",
    "Job": "simulations.cluster",
    "Layout": "simulations.cluster",
    "MixedFailures": "simulations.traces",
    "POLICY_MODELS": "simulations.cluster",
    "PeerSnapshot": "simulations.cluster",
    "Plan": "simulations.cluster",
    "PolicyModel": "simulations.cluster",
    "ReplicaCopy": "simulations.cluster",
    "Scenario": "simulations.cluster",
    "Schedule": "simulations.cluster",
    "SimContext": "simulations.cluster",
    "SimulatedPolicy": "simulations.policies",
    "SimulationResult": "simulations.cluster",
    "SnapshotPolicy": "simulations.cluster",
    "StrategyResult": "simulations.cluster",
    "TraceReplay": "simulations.traces",
    "WeibullFailures": "simulations.traces",
    "classify_events": "simulations.cluster",
    "daly_interval": "simulations.costs",
    "daly_waste": "simulations.costs",
    "exhaustion_probability": "simulations.cluster",
    "expected_exhaustions": "simulations.cluster",
    "llama3_failures": "simulations.traces",
    "make_policy_model": "simulations.cluster",
    "mean_ci": "simulations.cluster",
    "simulate": "simulations.cluster",
    "sweep": "simulations.cluster",
    "young_interval": "simulations.costs",
    "young_waste": "simulations.costs",
}
"""Each public name -> the module that defines it."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'simulations' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "CAUSES",
    "COMPONENTS",
    "POLICY_MODELS",
    "ActionKind",
    "CheckFree",
    "CheckFreePlus",
    "CheckpointRestart",
    "ClusterShape",
    "CostModel",
    "EmbeddingPartial",
    "EventFacts",
    "EventLog",
    "ExponentialFailures",
    "FailureEvents",
    "FailureModel",
    "Job",
    "Layout",
    "MixedFailures",
    "PeerSnapshot",
    "Plan",
    "PolicyModel",
    "ReplicaCopy",
    "Scenario",
    "Schedule",
    "SimContext",
    "SimulatedPolicy",
    "SimulationResult",
    "SnapshotPolicy",
    "StrategyResult",
    "TraceReplay",
    "WeibullFailures",
    "classify_events",
    "daly_interval",
    "daly_waste",
    "exhaustion_probability",
    "expected_exhaustions",
    "llama3_failures",
    "make_policy_model",
    "mean_ci",
    "simulate",
    "sweep",
    "young_interval",
    "young_waste",
]
