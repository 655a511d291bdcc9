"""A vision model on a generated image dataset: a plain ``nn.Sequential`` CNN split into
pipeline stages by torch's pipelining, fed through `batches_from_dataset`, a worker killed.

    python examples/vision.py

The dataset (`parallelism.workloads.shapes.Shapes`) draws each image from its index (a
shape class -- a square, a cross, a ring -- at a random place, plus noise), so it needs
nothing downloaded; swap in any map-style ``Dataset`` of (image, label) pairs
(``torchvision.datasets.ImageFolder`` is one). Runs on
an embedded local Ray, 2 stages x 2 replicas, in about a minute on two CPU cores.
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
from parallelism.workloads.shapes import CLASSES, SIZE, Shapes
from recovery import FailureSchedule, Kill, Trainer, TrainSpec, batches_from_dataset


def cnn(width: int = 16) -> nn.Sequential:
    """Four conv blocks and a classifier, one ``nn.Sequential``: its children are the
    blocks the balanced split cuts between."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, len(CLASSES))),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--no-kill",
        action="store_true",
        help="train without the injected failure (its final state digest is the same)",
    )
    args = parser.parse_args()
    per_replica, microbatches = 16, 2
    spec = TrainSpec.from_module(
        cnn,  # no split points: parameter-balanced for the job's 2 stages
        example_input=torch.zeros(per_replica // microbatches, 1, SIZE, SIZE),
        loss_fn=nn.functional.cross_entropy,
        make_optimizer=functools.partial(torch.optim.Adam, lr=3e-3),
        batches=batches_from_dataset(Shapes(4096), per_replica),
        val_batches=batches_from_dataset(Shapes(256, seed=1), per_replica, shuffle=False),
        microbatches=microbatches,
        name="shapes-cnn",
    )
    failures = FailureSchedule(
        [] if args.no_kill else [Kill(step=args.steps // 2, stage=0, replica=1)]
    )
    trainer = Trainer(
        spec, topology=Topology(2, 2), failures=failures, progress=True, eval_every=20
    )
    result = trainer.fit(args.steps)
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
