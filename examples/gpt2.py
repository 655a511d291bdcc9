"""A Hugging Face GPT-2 (random weights, nothing downloaded) split into pipeline stages by
torch's pipelining and trained on a text file through `batches_from_dataset`, a worker killed.

    pip install -e ".[hf]"          # transformers, an optional extra
    python examples/gpt2.py                  # the stdlib's own source as text
    python examples/gpt2.py --data my.txt    # any text file

The model is `transformers`' own ``GPT2LMHeadModel``, configured small, with its word
embedding and head untied (tied weights cannot be split across stages: each stage's copy
would train on its own) and dropout off (it would draw other numbers than the unsplit model
does). Two values cross the split -- the hidden states and the attention mask -- and travel
together. Runs on an embedded local Ray, 2 stages x 2 replicas, in a minute or two on two
CPU cores.
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


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GPT2Logits(nn.Module):
    """GPT-2 that returns its logits (the loss function's input)."""

    def __init__(self, layers: int = 4, dim: int = 64, seq: int = 64) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=256,  # bytes
            n_positions=seq,
            n_embd=dim,
            n_layer=layers,
            n_head=4,
            tie_word_embeddings=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        config._attn_implementation = "eager"
        self.gpt2 = GPT2LMHeadModel(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=idx, use_cache=False).logits


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
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit('this example needs transformers: pip install -e ".[hf]"')
    corpus = TokenCorpus.from_path(args.data) if args.data else TokenCorpus.stdlib(2_000_000)
    windows = TokenWindows(corpus, args.seq)
    per_replica, microbatches = 8, 2
    spec = TrainSpec.from_module(
        functools.partial(GPT2Logits, seq=args.seq),
        example_input=torch.zeros(per_replica // microbatches, args.seq, dtype=torch.long),
        loss_fn=loss_fn,
        make_optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        batches=batches_from_dataset(windows, per_replica),
        microbatches=microbatches,
        name="gpt2",
    )
    failures = FailureSchedule(
        [] if args.no_kill else [Kill(step=args.steps // 2, stage=0, replica=0)]
    )
    result = Trainer(spec, topology=Topology(2, 2), failures=failures, progress=True).fit(
        args.steps
    )
    print(f"loss: step 0 {result.losses[0]:.3f} -> step {args.steps - 1} {result.losses[-1]:.3f}")
    for event in result.events:
        print(f"recovery: step {event.step}, {event.strategy}, {event.seconds:.2f} s")
    # The same with --no-kill: the recovery ended where the run without a failure ends.
    print(f"final state digest: {result.state_digest()}")


if __name__ == "__main__":
    main()
