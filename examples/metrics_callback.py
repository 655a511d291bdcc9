"""Your metrics where you watch runs: a `Callback` that sends every step's loss and every
recovery to MLflow -- or, without MLflow, to a CSV file -- while a job trains with a worker
killed.

    python examples/metrics_callback.py                   # MLflow if installed, else a CSV
    python examples/metrics_callback.py --run-dir runs/x  # and TensorBoard files in runs/x/tensorboard

The callback is the dozen lines of `SendMetrics`: the driver calls its ``on_step`` at every
committed step, ``on_event`` at every recovery and ``on_fit_end`` once at the end. For
Weights & Biases, the same three methods call ``wandb.log({"loss": record.loss},
step=record.step)`` and ``wandb.finish()``. A hook that raises is logged, naming it, and
training goes on. Runs on an embedded local Ray, 2 stages x 2 replicas, in under a minute
on two CPU cores; needs neither MLflow nor a network.
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallelism import Topology
from recovery import Callback, FailureSchedule, Kill, RecoveryEvent, Trainer, TrainSpec
from recovery.runtime import FitResult, StepRecord

LogMetric = Callable[..., None]
"""``log_metric(name, value, step=...)``, as ``mlflow.log_metric`` takes it."""


class SendMetrics(Callback):
    """Sends a job's metrics to ``log_metric``, e.g. ``mlflow.log_metric``."""

    def __init__(self, log_metric: LogMetric, end: Callable[[], None]) -> None:
        self.log_metric, self.end = log_metric, end

    def on_step(self, record: StepRecord) -> None:
        self.log_metric("loss", record.loss, step=record.step)
        self.log_metric("tokens_per_s", record.tokens_per_s, step=record.step)
        if record.val_loss is not None:
            self.log_metric("val_loss", record.val_loss, step=record.step)

    def on_event(self, event: RecoveryEvent) -> None:
        self.log_metric("recovery_s", event.seconds, step=event.step)

    def on_fit_end(self, result: FitResult) -> None:
        self.end()


class CsvMetrics:
    """``log_metric`` for a machine without MLflow: rows of (step, name, value) in a CSV."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w", newline="")
        self._csv = csv.writer(self._file)
        self._csv.writerow(["step", "name", "value"])

    def log_metric(self, name: str, value: float, step: int) -> None:
        self._csv.writerow([step, name, value])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def model(width: int = 32) -> nn.Sequential:
    """A small MLP; the job's two stages split it where its parameters balance."""
    return nn.Sequential(
        nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    )


def batches(step: int, replica: int, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch for ``replica``: a regression, drawn from a seed."""
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :2].sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps to train")
    parser.add_argument(
        "--no-kill",
        action="store_true",
        help="train without the injected failure (its final state digest is the same)",
    )
    parser.add_argument(
        "--csv",
        type=Path,
        default=Path("runs/metrics_callback.csv"),
        help="where the metrics go without MLflow (default: runs/metrics_callback.csv)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="a run folder too: metrics.jsonl, the loss plot, TensorBoard files",
    )
    args = parser.parse_args()

    if importlib.util.find_spec("mlflow") is not None:
        import mlflow  # logs to ./mlruns unless MLFLOW_TRACKING_URI says otherwise

        mlflow.start_run()
        send = SendMetrics(mlflow.log_metric, end=mlflow.end_run)
        where = f"MLflow run {mlflow.active_run().info.run_id}"
    else:
        sink = CsvMetrics(args.csv)
        send = SendMetrics(sink.log_metric, end=sink.close)
        where = str(args.csv)

    spec = TrainSpec.from_module(
        model,
        example_input=torch.zeros(8, 8),  # one microbatch: 16 rows / 2 microbatches
        loss_fn=nn.functional.mse_loss,
        make_optimizer=functools.partial(torch.optim.Adam, lr=1e-2),
        batches=batches,
        val_batches=batches,
        microbatches=2,
        name="mlp",
    )
    failures = FailureSchedule(
        [] if args.no_kill else [Kill(step=args.steps // 2, stage=0, replica=1)]
    )
    trainer = Trainer(
        spec,
        topology=Topology(2, 2),
        failures=failures,
        eval_every=10,
        run_dir=args.run_dir,
        callbacks=[send],
    )
    result = trainer.fit(args.steps)
    print(f"loss: step 0 {result.losses[0]:.3f} -> step {args.steps - 1} {result.losses[-1]:.3f}")
    for event in result.events:
        print(f"recovery: step {event.step}, {event.strategy}, {event.seconds:.2f} s")
    print(f"metrics: sent to {where}")
    # The same with --no-kill: the recovery ended where the run without a failure ends.
    print(f"final state digest: {result.state_digest()}")


if __name__ == "__main__":
    main()
