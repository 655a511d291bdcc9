"""recovery/reference.py's ``device``: the CPU default is unchanged, and on a GPU the
single-process run matches the CPU one to rounding with its states back on the CPU."""

from __future__ import annotations

import pytest
import torch

from recovery.reference import train_reference
from tests.workloads import mlp_spec


def test_device_cpu_is_the_default_bit_for_bit() -> None:
    default = train_reference(mlp_spec(), stages=2, replicas=2, steps=3)
    on_cpu = train_reference(mlp_spec(), stages=2, replicas=2, steps=3, device="cpu")
    assert default.losses == on_cpu.losses
    for a, b in zip(default.states, on_cpu.states, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_it_matches_the_cpu_and_returns_cpu_states() -> None:
    on_cpu = train_reference(mlp_spec(), stages=2, replicas=2, steps=3)
    on_gpu = train_reference(mlp_spec(), stages=2, replicas=2, steps=3, device="cuda")
    assert on_gpu.losses == pytest.approx(on_cpu.losses, rel=1e-5)
    assert all(t.device.type == "cpu" for state in on_gpu.states for t in state.values())
