"""Your own model and data: a decoder written as one nn.Module, split into pipeline stages by
torch's pipelining, trained on a text file through `batches_from_dataset`, with a worker killed.

    python examples/custom_transformer.py                 # the stdlib's own source as text
    python examples/custom_transformer.py --data my.txt   # any text file

Runs on an embedded local Ray (2 stages x 2 replicas) in about a minute on two CPU cores and
prints the losses and the recoveries. The model is plain PyTorch; any map-style ``Dataset``
of (inputs, targets) works where `TokenWindows` is used.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallelism import Topology
from parallelism.datasets import TokenWindows
from parallelism.workloads.data import TokenCorpus
from recovery import FailureSchedule, Kill, Trainer, TrainSpec, batches_from_dataset

VOCAB = 256  # bytes


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class Decoder(nn.Module):
    """A byte-level decoder: embedding, ``layers`` blocks, norm, head."""

    def __init__(self, dim: int = 64, layers: int = 4, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.tokens(idx) + self.positions[:n]
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a text file (default: the stdlib's source)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--no-kill",
        action="store_true",
        help="train without the injected failure (its final state digest is the same)",
    )
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    # Bytes of a text file, or of the Python standard library's source (on every machine);
    # the last 5% held out.
    corpus = TokenCorpus.from_path(args.data) if args.data else TokenCorpus.stdlib(2_000_000)
    train, val = TokenWindows(corpus, args.seq), TokenWindows(corpus, args.seq, split="val")
    per_replica, microbatches = 8, 2

    spec = TrainSpec.from_module(
        functools.partial(Decoder, seq=args.seq),
        example_input=torch.zeros(per_replica // microbatches, args.seq, dtype=torch.long),
        loss_fn=loss_fn,
        make_optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
        batches=batches_from_dataset(train, per_replica),
        val_batches=batches_from_dataset(val, per_replica, shuffle=False),
        microbatches=microbatches,
        name="custom-decoder",
    )
    failures = FailureSchedule(
        [] if args.no_kill else [Kill(step=args.steps // 2, stage=1, replica=0)]
    )
    trainer = Trainer(
        spec, topology=Topology(2, 2), failures=failures, progress=True, eval_every=20
    )
    result = trainer.fit(args.steps)
    print(
        f"{len(train)} windows of {args.seq} bytes; split into 2 stages at "
        f"{spec.check_stages(2) if spec.check_stages else []}"
    )
    print(f"loss: step 0 {result.losses[0]:.3f} -> step {args.steps - 1} {result.losses[-1]:.3f}")
    held_out = [m["val_loss"] for m in result.metrics if m.get("val_loss") is not None]
    if held_out:
        print(f"held-out loss: {held_out[0]:.3f} (step 19) -> {held_out[-1]:.3f}")
    for event in result.events:
        print(f"recovery: step {event.step}, {event.strategy}, {event.seconds:.2f} s")
    # The same with --no-kill: the recovery ended where the run without a failure ends.
    print(f"final state digest: {result.state_digest()}")


if __name__ == "__main__":
    main()
