"""One worker state (recovery/state.py): every path that moves, stores or checks a worker's
state carries every field of it.

Each path gets a state with every field set -- trained parameters, BatchNorm buffers that
moved, AdamW moments, a step and a CheckFree rebuild's mark -- and a blank worker to fill,
and the test checks each field of `recovery.state.FIELDS` arrived. A field added to
`Progress` needs one sample value in `SAMPLES` (a test checks that), and is then checked on
every path at once. The live transfers between workers are checked the same way, with
these fixtures, over every `StateTransport` in tests/test_transport.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parallelism.buffers import persistent_buffers
from recovery.integrity.fingerprint import fingerprint
from recovery.reference import differences
from recovery.snapshots import DurableStore, PackedState, pack_state, unpack_state
from recovery.snapshots.checkpoint import load_checkpoint, save_checkpoint
from recovery.state import FIELDS, Progress, Rebuild, WorkerState, state_to_cpu
from recovery.wire import decode, encode

SAMPLES: dict[str, Any] = {"step": 7, "rebuild": Rebuild(5, 1.1, 20, 2)}
"""A value for each field of `Progress` other than its default."""
OTHERS: dict[str, Any] = {"step": 8, "rebuild": Rebuild(6, 1.2, None, 0)}
"""Another value for each, to see that a fingerprint tells them apart."""


def _module() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def source() -> WorkerState:
    """A state with every field set: trained weights, moved buffers, AdamW moments and a
    progress with every field at its sample value."""
    torch.manual_seed(0)
    module = _module()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for _ in range(3):
        module(torch.randn(5, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return WorkerState(module, optimizer, Progress(**SAMPLES))


def blank() -> WorkerState:
    """A worker to fill: other weights, its buffers at their start, no optimizer state."""
    torch.manual_seed(1)
    module = _module()
    return WorkerState(module, torch.optim.AdamW(module.parameters(), lr=1.0), Progress())


def fields_of(state: WorkerState) -> dict[str, Any]:
    """The value of each field of `FIELDS` in ``state``."""
    buffers = {name for name, _ in persistent_buffers(state.module)}
    model = {k: v.detach().clone() for k, v in state.module.state_dict().items()}
    got = {
        "parameters": {k: v for k, v in model.items() if k not in buffers},
        "buffers": {k: v for k, v in model.items() if k in buffers},
        "optimizer": decode(encode(state.optimizer.state_dict())),
    }
    for field in dataclasses.fields(Progress):
        got[f"progress.{field.name}"] = getattr(state.progress, field.name)
    assert set(got) == set(FIELDS), "fields_of must know every field of recovery.state.FIELDS"
    return got


# -- the paths ---------------------------------------------------------------------------


def _peer_snapshot(src: WorkerState, dst: WorkerState, tmp: Path) -> Progress:
    packed = pack_state(src, digests=True)
    arrived = PackedState.from_parts(packed.header(), packed.data.clone())  # over the wire
    assert arrived.corrupted() == ()
    return unpack_state(arrived, dst)


def _durable_snapshot(src: WorkerState, dst: WorkerState, tmp: Path) -> Progress:
    store = DurableStore(tmp / "durable")
    try:
        store.wait(store.write(0, src))
        store.commit(src.step, 1, {})
        return store.load(src.step, 0, dst)
    finally:
        store.close()


def _restart_checkpoint(src: WorkerState, dst: WorkerState, tmp: Path) -> Progress:
    save_checkpoint(tmp / "checkpoints", 0, src)
    return load_checkpoint(tmp / "checkpoints", 0, src.step, dst)


def _final_states(src: WorkerState, dst: WorkerState, tmp: Path) -> Progress:
    got = state_to_cpu(src)  # what FitResult.states holds
    assert set(got) == {"model", "optimizer", "progress"}
    dst.module.load_state_dict(got["model"])
    dst.optimizer.load_state_dict(got["optimizer"])
    return Progress.from_dict(got["progress"])


PATHS: dict[str, Callable[[WorkerState, WorkerState, Path], Progress]] = {
    "peer snapshot": _peer_snapshot,
    "durable snapshot and resume": _durable_snapshot,
    "restart checkpoint": _restart_checkpoint,
    "final states": _final_states,
}


def test_every_field_of_progress_has_a_sample() -> None:
    names = {f.name for f in dataclasses.fields(Progress)}
    assert set(SAMPLES) == names and set(OTHERS) == names
    assert all(SAMPLES[n] != OTHERS[n] for n in names)


@pytest.mark.parametrize("name", list(PATHS))
def test_every_path_carries_every_field(name: str, tmp_path: Path) -> None:
    src, dst = source(), blank()
    want = fields_of(src)
    assert differences(fields_of(dst), want), "the blank worker must differ in every field"
    progress = PATHS[name](src, dst, tmp_path)
    got = fields_of(WorkerState(dst.module, dst.optimizer, progress))
    for field in FIELDS:
        assert not differences(got[field], want[field], where=field), (name, field)


def _perturbed(field: str) -> WorkerState:
    """`source` with ``field`` (only) changed."""
    state = source()
    with torch.no_grad():
        if field == "parameters":
            next(state.module.parameters()).view(-1)[0] += 1.0
        elif field == "buffers":
            state.module[1].running_mean.view(-1)[0] += 1.0
        elif field == "optimizer":
            next(iter(state.optimizer.state.values()))["exp_avg"].view(-1)[0] += 1.0
    if field.startswith("progress."):
        name = field.removeprefix("progress.")
        progress = dataclasses.replace(state.progress, **{name: OTHERS[name]})
        return WorkerState(state.module, state.optimizer, progress)
    return state


@pytest.mark.parametrize("field", FIELDS)
def test_the_fingerprint_tells_every_field_apart(field: str) -> None:
    """The replica vote compares fingerprints: a replica that differs in any field -- a
    BatchNorm statistic, or the learning-rate scale of a rebuilt stage -- is found."""
    assert fingerprint(source()) == fingerprint(source())
    assert fingerprint(_perturbed(field)) != fingerprint(source()), field


def test_a_progress_from_the_wire_is_checked() -> None:
    """A garbled progress is a wire error, never a raw TypeError deep in a worker."""
    from parallelism.comm import GarbledMessage

    good = encode(Progress(3))
    assert decode(good) == Progress(3)
    with pytest.raises(GarbledMessage):
        decode(good.replace(b'"step":3', b'"step":-3'))
    with pytest.raises(GarbledMessage):
        decode(good.replace(b'"step":3', b'"step":"x"'))
