"""Small workloads for tests: user-style callbacks, shipped to Ray workers by value."""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from parallelism.workloads.llama_spec import llama_spec
from recovery import TrainSpec
from recovery.worker import StageWorker


def mlp_stage(stage: int, num_stages: int, width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh())


def relu_stage(stage: int, num_stages: int) -> nn.Module:
    """Another model of the same shapes as `mlp_stage`: its activation is a ReLU."""
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU())


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def adamw(params, lr: float = 1e-2) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=lr)


def sgd(params, lr: float = 0.1) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=lr)


def regression_batches(
    step: int, replica: int, num_replicas: int, *, size: int = 8, width: int = 16
):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(size, width, generator=g)
    return x, torch.sin(x)


def mlp_spec(**overrides) -> TrainSpec:  # type: ignore[no-untyped-def]
    """A user-defined spec: an MLP regression, one Linear+Tanh per stage."""
    kwargs = dict(
        build_stage=mlp_stage,
        loss_fn=mse,
        make_optimizer=adamw,
        batches=regression_batches,
        microbatches=4,
    )
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


@functools.cache
def tiny_llama(schedule: str = "1f1b", microbatches: int = 4, seed: int = 0) -> TrainSpec:
    """The built-in LLaMA workload at test size (cached: the corpus loads once)."""
    return llama_spec(
        preset="tiny",
        seq_len=32,
        microbatch_size=2,
        microbatches=microbatches,
        schedule=schedule,
        seed=seed,
        max_bytes=2_000_000,
    )


class EchoWorker(StageWorker):
    """A worker with a few trivial methods, for the `WorkerGroup` conformance test."""

    def echo(self, value: object) -> object:
        return value

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def boom(self) -> None:
        raise KeyError("user code failed")


# -- a whole model for `TrainSpec.from_module`, and a map-style dataset ----------------------


class MaskedBlock(nn.Module):
    """Causal self-attention and an MLP, each residual; takes the mask as a second input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        return x + a + self.mlp(x + a)


class TinyLM(nn.Module):
    """A whole decoder, written as a user would, never cut into stages by hand. Its mask is
    made once before the blocks, so it crosses every split point beside the hidden state."""

    def __init__(self, vocab: int = 32, dim: int = 16, blocks: int = 4, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MaskedBlock(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TokenSequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``size`` generated sequences of ``length + 1`` tokens; item = (inputs, next tokens).
    Every item is a pure function of its index."""

    def __init__(self, size: int = 64, length: int = 8, vocab: int = 32) -> None:
        self.size, self.length, self.vocab = size, length, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(7_919 * index + 1)
        tokens = torch.randint(self.vocab, (self.length + 1,), generator=g)
        return tokens[:-1], tokens[1:]


# -- models with buffers and dropout, on image data ------------------------------------------


def bn_cnn_spec(per_replica: int = 8, microbatches: int = 2, **overrides) -> TrainSpec:  # type: ignore[no-untyped-def]
    """A CNN with BatchNorm and dropout in every stage (`bn_cnn_stage`), on generated shape
    images that a random flip augments, with held-out images to evaluate on."""
    from parallelism.workloads.shapes import Shapes, bn_cnn_stage
    from recovery import batches_from_dataset

    kwargs = dict(
        build_stage=bn_cnn_stage,
        loss_fn=nn.functional.cross_entropy,
        make_optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
        batches=batches_from_dataset(Shapes(512, augment=True), per_replica),
        val_batches=batches_from_dataset(Shapes(64, seed=1), per_replica, shuffle=False),
        microbatches=microbatches,
        name="bn-cnn",
    )
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


class MaskedPairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Items whose input and target come from one random draw of torch's global generator
    (as a masking or augmenting dataset's do): ``(x * mask, mask)``. A stage that drew
    another mask than its pipeline's other end sees a target that does not fit its input."""

    def __init__(self, size: int = 64, width: int = 16) -> None:
        self.size, self.width = size, width

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        x = torch.randn(self.width, generator=g)
        mask = (torch.rand(self.width) < 0.5).float()  # the global generator
        return x * mask, mask


def held_out_batches(index: int, replica: int, num_replicas: int):  # type: ignore[no-untyped-def]
    """Held-out batches for `mlp_spec` (another draw than any training step's)."""
    return regression_batches(10_000 + index, replica, num_replicas)


def transformer_stage(stage: int, num_stages: int, vocab: int = 32, dim: int = 16) -> nn.Module:
    """Stage ``stage`` of a small language model: token embedding first, an encoder layer
    (attention, feed-forward, LayerNorm, dropout) in every stage, the head last."""
    parts: list[nn.Module] = []
    if stage == 0:
        parts.append(nn.Embedding(vocab, dim))
    parts.append(nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.1, batch_first=True))
    if stage == num_stages - 1:
        parts.append(nn.Linear(dim, vocab))
    return nn.Sequential(*parts)


def transformer_spec(per_replica: int = 4, microbatches: int = 2, **overrides) -> TrainSpec:  # type: ignore[no-untyped-def]
    """`transformer_stage` on `TokenSequences`, next-token loss, held-out sequences."""
    from recovery import batches_from_dataset

    kwargs = dict(
        build_stage=transformer_stage,
        loss_fn=lm_loss,
        make_optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
        batches=batches_from_dataset(TokenSequences(64), per_replica),
        val_batches=batches_from_dataset(TokenSequences(16, vocab=32), per_replica, seed=1),
        microbatches=microbatches,
        name="transformer",
    )
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


SLOW_WRITES = ".slow-writes.json"
"""A file in a durable snapshot folder that makes the writes into it slow (`slow_disk_stage`):
``{"seconds": s, "steps": [...]}``."""


def slow_disk_stage(stage: int, num_stages: int) -> nn.Module:
    """`mlp_stage`, built in a worker whose durable writes into a folder holding
    `SLOW_WRITES` take that many seconds longer for those steps: a slow disk (NFS, a large
    state) as the worker process itself meets it. Ray workers are other processes, so the
    spec installs it where it runs; the folder's file decides, so a worker process reused
    by a later job writes at full speed."""
    import json
    from pathlib import Path

    from recovery.snapshots.durable import DurableStore

    real = DurableStore._finish
    if not getattr(real, "slow_disk", False):

        def _finish(self, upload, step, rank, *args):  # type: ignore[no-untyped-def]
            marker = Path(self.root) / SLOW_WRITES
            if marker.is_file():
                slow = json.loads(marker.read_text())
                if step in slow["steps"]:
                    time.sleep(slow["seconds"])
            return real(self, upload, step, rank, *args)

        _finish.slow_disk = True  # type: ignore[attr-defined]
        DurableStore._finish = _finish  # type: ignore[method-assign]
    return mlp_stage(stage, num_stages)


def paced_stage(stage: int, num_stages: int) -> nn.Module:
    """`mlp_stage` whose every forward takes 20 ms longer: a job that trains for a while."""

    class Paced(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return super().forward(x)

    return Paced(nn.Linear(16, 16), nn.Tanh())
