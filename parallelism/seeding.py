"""Counter-based seeds: every random draw in a job is a pure function of named keys.

A worker never carries a random stream across steps. Its initial weights are drawn from
``derive_seed(seed, "init", stage)`` and its per-step randomness (dropout, sampling) from
``derive_seed(seed, "step", stage, replica, step)``. So the RNG state of a worker is fully
determined by the step number, and a rebuilt worker needs no RNG bytes to continue
bit-exactly -- only the step, which it receives with its state. The same holds on a GPU:
`seed_everything` goes through ``torch.manual_seed``, which seeds every CUDA device's
generator too (its Philox offset back to 0), so what a worker computing on CUDA draws
(``torch.cuda.get_rng_state``) is a function of the step as well, and a state transfer or
a snapshot carries no CUDA RNG bytes either (tests/test_devices.py).
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*keys: int | str) -> int:
    """A 63-bit seed from ``keys`` (stable across processes, machines and Python versions)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_everything(*keys: int | str) -> None:
    """Seed torch's global CPU (and CUDA) generators from ``keys``."""
    torch.manual_seed(derive_seed(*keys))
