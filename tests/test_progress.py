"""Progress that means the same on every device (parallelism/progress.py): on a GPU a
schedule action counts once its CUDA work completes, checked here with fake events and a
fake clock -- a long healthy step keeps progressing, a stuck one stops, and a wait queued
on the device names its peer until it completes."""

from __future__ import annotations

import torch

from parallelism import Topology
from parallelism.engine import StageEngine
from parallelism.progress import EventProgress, Progress, progress_for
from parallelism.schedule import build_schedule
from tests.workloads import mlp_spec

HANG_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeEvent:
    """An event that completes when the fake device gets to it."""

    def __init__(self, device: FakeDevice) -> None:
        self.device, self.index = device, -1

    def record(self) -> None:
        self.index = self.device.queued
        self.device.queued += 1

    def query(self) -> bool:
        return self.index < self.device.completed


class FakeDevice:
    def __init__(self) -> None:
        self.queued = 0
        self.completed = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)


def test_a_long_healthy_step_keeps_progressing_on_the_device() -> None:
    """The CPU queues every action at once (as with CUDA) and then blocks; the device
    finishes one action every 0.4 x the hang timeout: progress is never older than that."""
    clock, device = Clock(), FakeDevice()
    progress = EventProgress(device.event, clock)
    for _ in range(20):
        progress.mark()
    for _ in range(20):
        clock.now += 0.4 * HANG_S
        device.completed += 1
        assert clock.now - progress.at() < HANG_S
    assert progress.waiting_on() is None


def test_a_stuck_device_stops_progressing_though_the_cpu_moved_on() -> None:
    """The CPU returned from every call (a CPU clock would say "just progressed"), but the
    device stopped after the 3rd action: the idle time grows from there."""
    clock, device = Clock(), FakeDevice()
    progress = EventProgress(device.event, clock)
    for _ in range(10):
        progress.mark()
    clock.now += 1
    device.completed = 3
    stalled_at = progress.at()
    assert stalled_at == clock.now
    clock.now += HANG_S + 1
    progress.mark()  # the CPU goes on queuing: no progress until the device gets there
    assert clock.now - progress.at() > HANG_S
    assert progress.at() == stalled_at


def test_a_wait_queued_on_the_device_names_its_peer_until_it_completes() -> None:
    clock, device = Clock(), FakeDevice()
    progress = EventProgress(device.event, clock)
    progress.mark()
    progress.queued_wait(3)  # e.g. an NCCL receive from rank 3
    progress.mark()
    progress.queued_wait(-1)  # then an all-reduce
    assert progress.waiting_on() == 3
    device.completed = 2
    assert progress.waiting_on() == -1
    device.completed = 4
    assert progress.waiting_on() is None


def test_on_the_cpu_a_mark_is_progress_when_it_is_made() -> None:
    clock = Clock()
    progress = Progress(clock)
    clock.now += 5
    progress.mark()
    progress.queued_wait(2)
    assert progress.at() == clock.now and progress.waiting_on() is None
    assert type(progress_for(torch.device("cpu"))) is Progress


def _engine(progress: Progress) -> tuple[StageEngine, object]:
    spec = mlp_spec()
    top = Topology(1, 1)
    module = spec.build(0, 1)
    engine = StageEngine(
        module,
        stage=0,
        replica=0,
        topology=top,
        loss_fn=spec.loss_fn,
        device=torch.device("cpu"),
        progress=progress,
    )
    return engine, build_schedule(spec.schedule, 1, spec.microbatches, None)


def test_the_engines_progress_is_the_devices() -> None:
    """A real stage's step marks every action through its `Progress`: with a device that
    never completes anything, the step makes no progress however fast the CPU ran."""
    spec = mlp_spec()
    inputs, targets = spec.batches(0, 0, 1)
    mbs = spec.microbatches
    xs, ys = list(inputs.chunk(mbs)), list(targets.chunk(mbs))

    clock, stuck = Clock(), FakeDevice()
    engine, schedule = _engine(EventProgress(stuck.event, clock))
    clock.now += HANG_S + 1
    engine.run(schedule, None, xs, ys)  # type: ignore[arg-type]
    assert stuck.queued > 2 * mbs  # one mark per action at least
    assert clock.now - engine.progressed_at > HANG_S

    clock, done = Clock(), FakeDevice()
    engine, schedule = _engine(EventProgress(done.event, clock))
    done.completed = 10**9  # everything completes at once
    clock.now += HANG_S + 1
    engine.run(schedule, None, xs, ys)  # type: ignore[arg-type]
    assert engine.progressed_at == clock.now
