"""Where a worker computes and where its backend moves bytes: the one place that decides.

A worker has two devices. Its *compute* device holds the stage's module, optimizer state,
activations and gradients; its *wire* device is where the process-group backend reads and
writes: CUDA for NCCL, host memory for Gloo. They are the same device except in one mode,
Gloo communication with CUDA compute (``Trainer(backend="gloo", device="cuda")``, issue
15 item 5), which is what runs when several workers share one GPU (NCCL refuses two ranks
on one device) and what lets a one-GPU machine check the whole GPU compute path.

[Note: compute device and wire device]
Everything that crosses a process group -- activations, gradients, all-reduce buffers,
state transfers, snapshot bytes -- goes through `parallelism.comm.StageComm`, and only
there is the compute device told apart from the wire device: a send stages its tensor with
`parallelism.comm.to_wire` (into pinned host memory when a CUDA tensor goes over Gloo), a
receive lands on the wire and is copied to the compute device with
`parallelism.comm.from_wire`, and a collective reduces a staged copy that is copied back
when it is waited on. Callers allocate what they receive on ``comm.device`` (the compute
device) when it is state, and on ``comm.wire`` when it is bytes they decode on the host
(headers, descriptions). When the two devices are the same, as on CPU under Gloo and on
the GPU under NCCL, nothing is staged and the tensors are sent as before, bit for bit.

``device`` as a user gives it: ``None`` (the backend's own: CPU under Gloo, the worker's
GPU under NCCL), ``"cpu"`` or ``"cuda"``. The driver checks it (`check_device`); each
worker resolves it on its own process (`compute_device`), since only there does
``CUDA_VISIBLE_DEVICES`` name the GPU Ray gave it.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

import torch

__all__ = [
    "BACKENDS",
    "CUBLAS_WORKSPACE",
    "DEVICES",
    "Backend",
    "Device",
    "check_device",
    "compute_device",
    "deterministic_cuda",
    "wire_device",
]

Backend = Literal["gloo", "nccl"]
"""The communication backends: Gloo (CPU, or CUDA staged through host memory) or NCCL."""
BACKENDS: tuple[Backend, ...] = get_args(Backend)
Device = Literal["cpu", "cuda"]
"""The compute devices a user can ask for (``None``: the backend's own)."""
DEVICES: tuple[Device, ...] = get_args(Device)

CUBLAS_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` for deterministic cuBLAS (what torch's reproducibility notes
ask for with ``torch.use_deterministic_algorithms(True)``)."""


def check_device(backend: str, device: str | None, *, cuda_available: bool | None = None) -> None:
    """Refuse, on the driver and before anything starts, a device the backend cannot use.

    ``cuda_available``: whether this machine has CUDA (default: ``torch.cuda.is_available()``);
    the driver is taken to see the GPUs its workers will.

    Raises:
        ValueError: for a device that is not one of `DEVICES` (or None), ``nccl`` with
            ``device="cpu"`` (NCCL moves only GPU memory), or ``"cuda"`` on a machine
            without CUDA.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if device is None:
        return
    if device not in DEVICES:
        raise ValueError(
            f"unknown device {device!r}; choose one of {DEVICES} (or None: CPU under gloo, "
            "the worker's GPU under nccl). A device index is not accepted: each worker "
            "computes on the GPU Ray gives it"
        )
    if backend == "nccl" and device == "cpu":
        raise ValueError(
            "backend 'nccl' moves GPU memory only, it cannot train on device 'cpu': use "
            "backend='gloo' for CPU training, or device='cuda'"
        )
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if device == "cuda" and not available:
        raise ValueError(
            "device 'cuda' was asked for, but torch.cuda.is_available() is False on the "
            "driver (no GPU, or a CPU-only torch build): train on device='cpu' (or None)"
        )


def compute_device(backend: str, device: str | None) -> torch.device:
    """The device a worker computes on, resolved in the worker's own process.

    Under Ray a worker that asks for a GPU (or a fraction of one) sees only that GPU
    (``CUDA_VISIBLE_DEVICES``), so it is ``cuda:0``; workers sharing one GPU all see it
    as ``cuda:0`` too.

    Raises:
        ValueError: as `check_device`, and for ``cuda`` when this process sees no GPU (a
            Ray worker that asked for none: see `recovery.groups.resources.worker_ask`).
    """
    check_device(backend, device)
    if device is None:
        device = "cuda" if backend == "nccl" else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"backend {backend!r} with device 'cuda': this worker sees no GPU (a Ray worker "
            "that asks for no GPU is shown none; keep worker_resources['GPU'] above 0)"
        )
    return torch.device("cuda", 0)


def wire_device(backend: str, compute: torch.device) -> torch.device:
    """Where ``backend`` moves bytes for a worker computing on ``compute``: host memory for
    Gloo, the worker's GPU for NCCL (see [Note: compute device and wire device]).

    Raises:
        ValueError: for an unknown backend, or NCCL with a compute device that is not CUDA.
    """
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        if compute.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA compute device, got {compute}")
        return compute
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def deterministic_cuda(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Make this process's CUDA computation deterministic: ``CUBLAS_WORKSPACE_CONFIG`` (kept
    if the user set it) and ``torch.use_deterministic_algorithms(True)``. Call it before the
    first CUDA work: cuBLAS reads the variable when its handle is created. Returns whether
    CUDA was already initialised (then a cuBLAS handle may predate the variable).

    Every replica of a stage must compute the same bits from the same inputs, and a rebuilt
    worker the same bits as the one it replaces (the ``torch.equal`` oracles): CPU kernels
    are deterministic already, CUDA ones (atomics in scatter/index backward, cuBLAS
    split-K) only when asked.
    """
    environ = os.environ if environ is None else environ
    environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    return torch.cuda.is_initialized()
