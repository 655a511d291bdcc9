"""Fingerprints of a worker's state, and the bit flip that silent data corruption is.

The replicas of a stage are bit-identical by construction (same seed, same all-reduced
gradients, same deterministic optimizer), so a hash of the raw bytes of each replica's
parameters and optimizer state, compared across its stage group, finds a corrupted
replica exactly (`recovery.integrity.fingerprint_vote` compares them). The hash is
XXH3-64 over each tensor's bytes, one digest per tensor so that a mismatch can name the
tensor: a float sum could cancel or round a flipped low bit away, a hash of the bytes
cannot. XXH3 is not a
cryptographic hash -- corruption is not an adversary -- and it runs faster than memory
copies (~20 GB/s on one core here, against ~1 GB/s for BLAKE2b), so that checking every
transfer and peer snapshot costs little next to moving the bytes.

`flip_bit` is what `recovery.faults.BitFlip` does to a worker: one mantissa bit of one
element, so the value stays finite and the non-finite check never sees it.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import xxhash

from recovery.state import WorkerState
from recovery.wire import encode

__all__ = [
    "DESCRIPTION",
    "RECOMMENDED_FINGERPRINT_EVERY",
    "Fingerprint",
    "digest",
    "fingerprint",
    "flip_bit",
    "flip_one",
    "raw_bytes",
    "state_tensors",
]

RECOMMENDED_FINGERPRINT_EVERY = 100
"""The check interval K to use when turning fingerprints on without a reason to choose
another (``train.py --fingerprint-every`` with no value). A check hashes about 3x the
parameter bytes (parameters and AdamW moments) and exchanges one digest per tensor, so
its cost per step is about 1/K of a checked step's extra time: at K=100 that is under 1%
on the jobs `scripts/bench.py fingerprint` measures (docs/silent-data-corruption.md),
and a flip is found within 100 steps. A smaller K finds a flip sooner and rolls back
fewer steps; only at K=1 is a flip with a majority against it (3+ replicas) rebuilt
without any rollback (see [Note: fingerprint vote] in recovery/integrity/fingerprint_vote.py).
`RecoveryPolicy.fingerprint_every` stays off by default: checks cost every job something,
and need two or more replicas."""

DESCRIPTION = "description"
"""The fingerprint's entry for everything but the tensors (see `fingerprint`)."""

Fingerprint = dict[str, str]
"""Tensor name -> hex digest of its bytes, 64 bits (a false agreement is a 2^-64 event per
tensor; parameters by name, optimizer state as
``optim.<parameter name>.<key>``)."""

_MANTISSA_BITS = {torch.float32: 23, torch.float64: 52, torch.float16: 10, torch.bfloat16: 7}
"""Mantissa bits per floating dtype: flipping one of them keeps a finite value finite."""


def state_tensors(state: WorkerState, *, optimizer: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The tensors a fingerprint covers, named and ordered as every path moves them
    (`WorkerState.describe`): the module's parameters and buffers, then (``optimizer``) the
    optimizer's tensors."""
    meta, tensors, names = state.describe()
    count = len(meta["model"]) if not optimizer else len(tensors)
    return list(zip(names[:count], tensors[:count], strict=True))


def _canonical(obj: Any) -> Any:
    """``obj`` with every dict's items in key order, for a digest that does not depend on
    the order entries were inserted in (a received optimizer's state, say)."""
    if isinstance(obj, dict):
        return {"__sorted__": [[_canonical(k), _canonical(obj[k])] for k in sorted(obj, key=str)]}
    if isinstance(obj, list | tuple):
        return [_canonical(v) for v in obj]
    return obj


def digest(tensor: torch.Tensor) -> str:
    """The hex XXH3-64 digest of ``tensor``'s raw bytes (what a fingerprint holds per tensor)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return xxhash.xxh3_64(raw_bytes(data.contiguous())).hexdigest()


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in memory order, without a copy (what
    `digest` hashes; a hash taken piece by piece over them is the same)."""
    # As uint8: numpy has no bfloat16, and a byte view fits every dtype.
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def fingerprint(state: WorkerState, *, optimizer: bool = True) -> Fingerprint:
    """The fingerprint of a worker's whole state: one digest per tensor (`state_tensors`)
    and one, ``description``, of everything else it holds -- the optimizer's scalars and
    hyper-parameters (its learning rates included) and the progress (the step and a
    rebuild's mark). ``optimizer=False``: without the optimizer, for a sharded optimizer
    whose replicas hold different shards."""
    meta, tensors, names = state.describe()
    count = len(tensors) if optimizer else len(meta["model"])
    found = {name: digest(t) for name, t in zip(names[:count], tensors[:count], strict=True)}
    rest = {"model": meta["model"], "progress": meta["progress"]}
    if optimizer:
        rest["optimizer"] = meta["optimizer"]
    found[DESCRIPTION] = xxhash.xxh3_64(encode(_canonical(rest))).hexdigest()
    return found


def flip_bit(state: WorkerState, seed: int, *, optimizer: bool = True) -> str:
    """Flip one mantissa bit of one element of one floating tensor of the state, chosen
    from ``seed`` (a finite value stays finite). Returns ``"<tensor>[<element>] bit <b>"``.

    Raises:
        ValueError: if the state has no floating tensor with an element.
    """
    return flip_one(state_tensors(state, optimizer=optimizer), seed)


def flip_one(tensors: list[tuple[str, torch.Tensor]], seed: int) -> str:
    """`flip_bit` over any named contiguous tensors (in place): one mantissa bit of one
    element of one floating tensor, chosen from ``seed``. Returns what it flipped.

    Raises:
        ValueError: if no tensor is floating with an element.
    """
    candidates = [(name, t) for name, t in tensors if t.dtype in _MANTISSA_BITS and t.numel() > 0]
    if not candidates:
        raise ValueError("a bit flip needs a floating parameter or optimizer tensor")
    rng = random.Random(seed)
    name, tensor = rng.choice(candidates)
    index = rng.randrange(tensor.numel())
    bit = rng.randrange(_MANTISSA_BITS[tensor.dtype])
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    with torch.no_grad():
        flat = tensor.view(-1).view(ints)  # parameters and states are contiguous
        flat[index] ^= 1 << bit
    return f"{name}[{index}] bit {bit}"
