"""The engine's math: pipeline x data parallel equals plain training.

Each job is the real controller over threads (`tests.jobs`): real workers, Gloo groups and
schedules, no Ray.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from parallelism import Topology
from parallelism import engine as engine_mod
from parallelism.comm import Rendezvous, StageComm, host_store
from parallelism.schedule import build_schedule
from recovery import RecoveryPolicy, SnapshotPolicy
from recovery.reference import train_reference
from recovery.runtime import Controller, Phase
from tests.jobs import drive, in_threads, make
from tests.workloads import mlp_spec, sgd, tiny_llama

# float32 tolerances of PP x DP against one process (what these tests reach): the only
# differences are the order of floating-point sums (microbatch accumulation, all-reduce).
# Losses agree to ~2e-7 relative. Weights agree to ~1e-7 relative under SGD; under AdamW
# the normalised update m/sqrt(v) turns last-bit differences of near-zero gradient entries
# into differences of up to ~1e-6 absolute after a few steps (lr 3e-3).
LOSS_RTOL = 1e-6
WEIGHT_TOL = {"rtol": 1e-5, "atol": 2e-6}

# Snapshots are no part of the math (and would only slow the jobs down).
NO_SNAPSHOTS = RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=None))


def _assert_states_close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float
) -> None:
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


def _train(spec: object, top: Topology, steps: int) -> Controller:
    """A job trained ``steps`` steps without a failure: its losses in ``records``, its final
    states in ``final_states``."""
    controller, _ = make(spec, top, policy=NO_SNAPSHOTS, steps=steps)  # type: ignore[arg-type]
    phases = drive(controller)  # several steps to a transition (see [Note: batched steps])
    assert set(phases[:-1]) == {Phase.RUNNING} and phases[-1] is Phase.FINISHED
    assert not controller.events
    assert [r.step for r in controller.records] == list(range(steps))
    return controller


def _model(controller: Controller, stage: int, replica: int) -> dict[str, torch.Tensor]:
    return controller.final_states[(stage, replica)]["model"]  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages, replicas", [(4, 2), (2, 3), (1, 2), (3, 1)])
def test_pipeline_data_parallel_equals_single_process(
    schedule: str, stages: int, replicas: int
) -> None:
    spec = tiny_llama(schedule=schedule)
    steps = 6
    job = _train(spec, Topology(stages, replicas), steps)
    losses = [r.loss for r in job.records]
    ref = train_reference(spec, stages=stages, replicas=replicas, steps=steps)
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref.losses, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
    for s in range(stages):
        for r in range(replicas):
            _assert_states_close(_model(job, s, r), ref.state(s), **WEIGHT_TOL)
        # replicas of one stage are bit-identical: they applied the same averaged gradient
        for r in range(1, replicas):
            for k, v in _model(job, s, 0).items():
                assert torch.equal(v, _model(job, s, r)[k])


def test_user_defined_spec_trains_like_reference() -> None:
    spec = mlp_spec(make_optimizer=sgd)
    job = _train(spec, Topology(3, 2), 5)
    losses = [r.loss for r in job.records]
    ref = train_reference(spec, stages=3, replicas=2, steps=5)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref.losses), rtol=LOSS_RTOL, atol=0
    )
    for s in range(3):
        _assert_states_close(_model(job, s, 1), ref.state(s), rtol=1e-6, atol=1e-7)


def test_reformed_generation_continues_identically() -> None:
    """Tearing the process groups down and forming a new generation changes nothing."""
    spec = tiny_llama()
    top = Topology(2, 2)
    a = _train(spec, top, 4)
    b, _ = make(spec, top, policy=NO_SNAPSHOTS, steps=4)
    # One step a call and nothing sent ahead, so that no call is in flight at a re-forming:
    # one would fail (a worker that finished a collective leaves while a peer is in it).
    assert b.runner is not None
    b.runner.may_pipeline = lambda nxt: False  # type: ignore[method-assign]
    try:
        for step in range(4):
            assert b.advance() is Phase.RUNNING and b.step == step + 1
            b.members.form_generation()  # what REFORMING does, here without a failure
        assert b.generation == 4
    finally:
        phases = drive(b)
    assert phases == [Phase.FINISHED] and not b.events
    for s in range(2):
        for r in range(2):
            for k, v in _model(a, s, r).items():
                assert torch.equal(v, _model(b, s, r)[k])


def test_closing_a_worker_wakes_peers_blocked_on_it() -> None:
    """[Note: tearing down on failure]: a live peer that gives up must not leave others hanging."""
    store = host_store("127.0.0.1")
    top = Topology(3, 1)
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 20)
    comms = in_threads([lambda r=r: StageComm(rdzv, top, r, "gloo", "127.0.0.1") for r in range(3)])

    def blocked() -> float:
        start = time.perf_counter()
        with pytest.raises(RuntimeError):
            comms[0].recv_activation(1)
        return time.perf_counter() - start

    def gives_up() -> None:
        time.sleep(0.3)
        comms[1].close()

    waited, _ = in_threads([blocked, gives_up], timeout_s=30)
    assert not isinstance(waited, BaseException), waited
    assert waited < 3.0  # not the 20 s timeout
    for c in comms:
        c.close()


def test_a_waiter_gives_up_when_its_own_groups_close_even_if_gloo_would_not_wake_it() -> None:
    """The race CI met under load: a work queued while another thread closes the groups.

    Gloo may leave such a work pending until its own timeout; cutting the sockets does not
    reach it. Here the cut is skipped on purpose (no transport), so `close` only aborts the
    groups, which alone leaves a queued work pending: the waiter must still give up within
    a slice of the close, not after the group's own timeout (5 s here).
    """
    store = host_store("127.0.0.1")
    top = Topology(1, 2)
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 5)
    comms = in_threads([lambda r=r: StageComm(rdzv, top, r, "gloo", "127.0.0.1") for r in range(2)])
    work = comms[0].allreduce_stage(torch.ones(8))  # replica 1 never joins
    comms[0]._transport = None

    def blocked() -> float:
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match="Connection closed"):
            comms[0].wait(work)
        return time.perf_counter() - start

    def closes() -> None:
        time.sleep(0.3)
        comms[0].close()

    waited, _ = in_threads([blocked, closes], timeout_s=30)
    assert not isinstance(waited, BaseException), waited
    assert waited < 2.0
    comms[1].close()


class _PartlyUsed(torch.nn.Module):
    """Five linear layers and, first in the flat buffer, one that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(64, 64)
        self.body = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def _overlap_run(replicas: int, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Two steps of a 1 x ``replicas`` MLP (one parameter unused), two microbatches each, on
    real Gloo groups in threads; per replica: the reduced gradients of the last step, the
    order its bucket all-reduces started in, and how many had started before the schedule
    ended."""
    monkeypatch.setattr(engine_mod, "FIRST_BUCKET_BYTES", 4 * 64 * 64)
    monkeypatch.setattr(engine_mod, "BUCKET_BYTES", 2 * 4 * 64 * 64)
    if not overlap:
        monkeypatch.setattr(engine_mod.StageEngine, "_make_buckets", lambda self: None)
    top = Topology(1, replicas)
    store = host_store("127.0.0.1")
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 20)
    comms = in_threads(
        [lambda r=r: StageComm(rdzv, top, r, "gloo", "127.0.0.1") for r in range(replicas)]
    )
    schedule = build_schedule("1f1b", 1, 2)
    torch.manual_seed(0)  # here, not in the threads: the global generator is shared
    modules = [_PartlyUsed() for _ in range(replicas)]
    for m in modules[1:]:
        m.load_state_dict(modules[0].state_dict())

    def replica(r: int) -> tuple[list[torch.Tensor], list[int], int]:
        module = modules[r]
        eng = engine_mod.StageEngine(
            module,
            stage=0,
            replica=r,
            topology=top,
            loss_fn=torch.nn.functional.mse_loss,
            device=torch.device("cpu"),
        )
        started: list[int] = []
        reduce = eng._reduce_gradients
        before_end: list[int] = []

        def launch(tensor: torch.Tensor) -> Any:
            assert eng._grad_flat is not None
            started.append(tensor.data_ptr())
            return StageComm.allreduce_stage(comms[r], tensor)

        def reduce_spy(*args: Any) -> None:
            before_end.append(len(started))
            reduce(*args)

        comms[r].allreduce_stage = launch  # type: ignore[method-assign]
        eng._reduce_gradients = reduce_spy  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(r)
        for _ in range(2):
            started.clear()
            before_end.clear()
            inputs = [torch.randn(4, 64, generator=g) for _ in range(2)]
            targets = [torch.randn(4, 64, generator=g) for _ in range(2)]
            eng.run(schedule, comms[r], inputs, targets)
            grads = [p.grad.clone() for p in eng.params]  # type: ignore[union-attr]
            module.zero_grad(set_to_none=True)
        if not eng._buckets:  # one all-reduce, of the whole buffer
            assert started == [eng._grad_flat.data_ptr()]  # type: ignore[union-attr]
            return grads, [], before_end[0]
        order = [[b.flat.data_ptr() for b in eng._buckets].index(ptr) for ptr in started]
        return grads, order, before_end[0]

    out = in_threads([lambda r=r: replica(r) for r in range(replicas)])
    for c in comms:
        c.close()
    for o in out:
        assert not isinstance(o, BaseException), o
    return out


@pytest.mark.parametrize("replicas", [2, 3])
def test_allreduce_overlaps_backward_in_bucket_order(
    replicas: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: overlapped all-reduce]: buckets start during the last backward, in bucket
    order on every replica (the unused parameter's bucket last, after the schedule), and
    every replica ends with the same reduced gradients; with two replicas they are the bits
    of one all-reduce over the whole buffer."""
    out = _overlap_run(replicas, True, monkeypatch)
    for grads, order, before_end in out:
        assert order == list(range(len(order))) and len(order) >= 3
        assert 1 <= before_end < len(order)  # some during backward; the unused one after
        for g, g0 in zip(grads, out[0][0], strict=True):
            assert torch.equal(g, g0)
    if replicas == 2:
        monkeypatch.undo()
        whole = _overlap_run(replicas, False, monkeypatch)
        assert whole[0][1] == []
        for g, g0 in zip(out[0][0], whole[0][0], strict=True):
            assert torch.equal(g, g0)


class _Sometimes(torch.nn.Module):
    """Three linear layers; the middle one only when ``use_middle`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.middle, self.b = (torch.nn.Linear(64, 64) for _ in range(3))
        self.use_middle = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.use_middle:
            x = self.middle(x)
        return self.b(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("microbatches", "kept"), [(1, False), (2, False), (1, True)])
def test_reduced_gradients_and_norm_are_those_of_separate_gradients(
    microbatches: int, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flat buffer is never zeroed: each gradient is copied in as backward makes it
    (`StageEngine._place`). A parameter used in one step and not in the next gets a zero in
    the next -- not the last step's value -- and the reduced gradients and their norm are,
    bit for bit, the average of the replicas' own gradients and its ``get_total_norm``,
    with one bucket per layer (norms taken bucket by bucket). ``kept``: the engines take
    kept buffers full of NaN (see [Note: a kept gradient buffer]); none of it shows."""
    monkeypatch.setattr(engine_mod, "FIRST_BUCKET_BYTES", 4 * 64 * 64)
    monkeypatch.setattr(engine_mod, "BUCKET_BYTES", 4 * 64 * 64)
    monkeypatch.setattr(engine_mod, "_KEPT", [])
    if kept:
        size = sum(p.numel() for p in _Sometimes().parameters())
        engine_mod._KEPT.extend(torch.full((size,), float("nan")) for _ in range(2))
    top = Topology(1, 2)
    store = host_store("127.0.0.1")
    rdzv = Rendezvous("127.0.0.1", store.port, "gen0", 20)
    comms = in_threads([lambda r=r: StageComm(rdzv, top, r, "gloo", "127.0.0.1") for r in range(2)])
    schedule = build_schedule("1f1b", 1, microbatches)
    torch.manual_seed(0)
    modules = [_Sometimes() for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    data = torch.Generator().manual_seed(1)
    batches = [
        [[torch.randn(4, 64, generator=data) for _ in range(2 * microbatches)] for _ in range(2)]
        for _ in range(3)
    ]  # [step][replica] -> microbatch inputs, then targets
    uses = [True, False, True]

    def replica(r: int) -> list[tuple[list[torch.Tensor], float]]:
        module = modules[r]
        eng = engine_mod.StageEngine(
            module, stage=0, replica=r, topology=top,
            loss_fn=torch.nn.functional.mse_loss, device=torch.device("cpu"),
        )  # fmt: skip
        out = []
        for step, use in enumerate(uses):
            module.use_middle = use
            data = batches[step][r]
            stats = eng.run(schedule, comms[r], data[:microbatches], data[microbatches:])
            assert eng._bound()
            out.append(([p.grad.clone() for p in eng.params], stats.grad_norm))  # type: ignore[union-attr]
            module.zero_grad(set_to_none=True)
        return out

    got = in_threads([lambda r=r: replica(r) for r in range(2)])
    for c in comms:
        c.close()
    assert engine_mod._KEPT == []  # taken, if there were any
    assert not isinstance(got[0], BaseException), got[0]
    assert not isinstance(got[1], BaseException), got[1]
    for step, use in enumerate(uses):
        own = []
        for r in range(2):  # the same module (weights never stepped), plain autograd
            module = modules[r]
            module.use_middle = use
            data = batches[step][r]
            for x, y in zip(data[:microbatches], data[microbatches:], strict=True):
                (torch.nn.functional.mse_loss(module(x), y) / microbatches).backward()
            own.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                        for p in module.parameters()])  # fmt: skip
            module.zero_grad(set_to_none=True)
        expected = [(g0 + g1) / 2 for g0, g1 in zip(*own, strict=True)]
        for r in range(2):
            grads, norm = got[r][step]
            for g, e in zip(grads, expected, strict=True):
                assert torch.equal(g, e)
            assert norm == float(torch.nn.utils.get_total_norm(expected))
        assert use or not expected[2].any()  # the middle layer's weight: a zero when unused


def test_a_kept_buffer_serves_the_next_engine_of_its_size_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: a kept gradient buffer]: `keep_buffer` leaves a touched buffer (and its
    engine's hooks removed); the next engine of the same size takes it, one of another size
    drops it, and ``drop_kept_buffers`` drops it too."""
    monkeypatch.setattr(engine_mod, "_KEPT", [])
    top = Topology(1, 2)

    def engine(module: torch.nn.Module) -> engine_mod.StageEngine:
        return engine_mod.StageEngine(
            module, stage=0, replica=0, topology=top,
            loss_fn=torch.nn.functional.mse_loss, device=torch.device("cpu"),
        )  # fmt: skip

    module = torch.nn.Linear(8, 8)
    first = engine(module)
    first.keep_buffer()
    assert first._hooks == [] and first._grad_flat is None
    (buffer,) = engine_mod._KEPT
    assert buffer.numel() == 72 and not buffer.any()
    second = engine(torch.nn.Linear(8, 8))
    second._bind_gradients()
    assert second._grad_flat is buffer and engine_mod._KEPT == []
    second.keep_buffer()
    engine(torch.nn.Linear(8, 4))._bind_gradients()  # another size: a new one, the kept dropped
    assert engine_mod._KEPT == []
    engine(torch.nn.Linear(8, 8)).keep_buffer()
    engine_mod.drop_kept_buffers()
    assert engine_mod._KEPT == []


def test_a_spares_warm_up_keeps_the_buffer_for_the_stage_it_takes_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hot spare's warm-up keeps its stage's gradient buffer; the stage it is set up for
    next takes it at its first step; a worker parked for another job drops it."""
    from recovery.worker.stage import StageWorker

    monkeypatch.setattr(engine_mod, "_KEPT", [])
    spec, top = mlp_spec(), Topology(1, 2)
    worker = StageWorker()
    worker.warm(spec, top, "gloo")
    (kept,) = engine_mod._KEPT
    worker.setup(spec, top, 1, "gloo")
    assert kept.numel() == sum(p.numel() for p in worker.engine.params)
    worker.engine._bind_gradients()  # what its first step does first
    assert worker.engine._grad_flat is kept and engine_mod._KEPT == []
    worker.reset(release=False)
    worker.warm(spec, top, "gloo")
    assert len(engine_mod._KEPT) == 1
    worker.reset()  # parked: gives its memory back
    assert engine_mod._KEPT == []
