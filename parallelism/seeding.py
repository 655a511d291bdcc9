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

import contextlib
import hashlib
import random
import threading
from collections.abc import Iterator

import numpy as np
import torch


def derive_seed(*keys: int | str) -> int:
    """A 63-bit seed from ``keys`` (stable across processes, machines and Python versions)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_everything(*keys: int | str) -> None:
    """Seed torch's global CPU (and CUDA) generators from ``keys``."""
    torch.manual_seed(derive_seed(*keys))


@contextlib.contextmanager
def seeded(*keys: int | str) -> Iterator[None]:
    """Run a block with every random generator user code may draw from -- torch's (CPU and
    CUDA), Python's ``random`` and NumPy's global one -- seeded from ``keys``, and give each
    its state back after: the block's draws are a pure function of ``keys`` and take
    nothing from the streams around it."""
    seed = derive_seed(*keys)
    state = random.getstate()
    np_state = np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % (1 << 32))
            yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


class Randomness:
    """A worker's random streams: what a step seeds and draws from, in one place, so that
    workers that are threads of one process (recovery/groups/thread_group.py) can keep
    streams of their own (`ThreadRandomness`). This one is a process's: torch's global
    generators (CPU and CUDA), Python's and NumPy's.
    """

    def seed(self, *keys: int | str) -> None:
        """Start the worker's stream at ``keys`` (a step: its dropout, its sampling)."""
        seed_everything(*keys)

    def drawing(self, *keys: int | str) -> contextlib.AbstractContextManager[None]:
        """A block whose draws come from a stream of ``keys`` alone (`seeded`), the worker's
        own stream unchanged by it."""
        return seeded(*keys)

    def compute(self) -> contextlib.AbstractContextManager[None]:
        """A block of computation that draws from the worker's stream (a forward pass)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """A block after which the worker's stream is as before it (an evaluation)."""
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        state, np_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=devices):
                yield
        finally:
            random.setstate(state)
            np.random.set_state(np_state)


GENERATORS_LOCK = threading.RLock()
"""Held while a thread worker uses the process's global generators: while its stream is
swapped in (`ThreadRandomness`), and while it seeds and builds (the thread group's setup,
warm-up and rebuild)."""


class ThreadRandomness(Randomness):
    """The random streams of a worker that is a thread among others in one process: its
    own copy of torch's CPU generator state, swapped into the global generator (under a
    process-wide lock) only for the blocks that draw. Without it, workers' dropout masks
    would depend on how their threads interleave. CPU only (the thread group's workers
    compute on the CPU); a block that draws must not wait on another worker (a forward
    pass does not: sends and receives are the schedule's own actions).
    """

    def __init__(self) -> None:
        self._state = torch.Generator().manual_seed(0).get_state()
        self.waiting = False
        """Whether the worker is waiting for another worker's draws to end: it waits on a
        peer, as in a collective (what the hang detection must know)."""

    def seed(self, *keys: int | str) -> None:
        self._state = torch.Generator().manual_seed(derive_seed(*keys)).get_state()

    @contextlib.contextmanager
    def drawing(self, *keys: int | str) -> Iterator[None]:
        with GENERATORS_LOCK, seeded(*keys):
            yield

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if not GENERATORS_LOCK.acquire(blocking=False):
            self.waiting = True
            GENERATORS_LOCK.acquire()
            self.waiting = False
        try:
            outside = torch.get_rng_state()
            torch.set_rng_state(self._state)
            try:
                yield
            finally:
                self._state = torch.get_rng_state()
                torch.set_rng_state(outside)
        finally:
            GENERATORS_LOCK.release()

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        state = self._state.clone()
        try:
            yield
        finally:
            self._state = state
