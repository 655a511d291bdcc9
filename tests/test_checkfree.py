"""Tests of the CheckFree / CheckFree+ recovery math in `recovery.strategies.checkfree` and of
the CheckFree+ edge replicas in `parallelism.llama`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from parallelism.schedule import swapped_routes
from parallelism.seeding import seed_everything
from parallelism.workloads.llama import (
    LlamaConfig,
    build_llama_stage,
    edge_partner,
    edge_replica_home,
    edge_replica_keys,
    llama_loss,
    partition_layers,
)
from recovery.errors import RedundancyExhausted
from recovery.strategies import (
    Averaging,
    CheckFreeConfig,
    GradNormTracker,
    clip_stage_gradients,
    copy_neighbor,
    edge_copy,
    load_optimizer_moments,
    neighbor_average,
    neighbor_weights,
    optimizer_moments,
    random_reinit,
    rebuild_stage,
    sum_shared_gradients,
    uniform_average,
)
from simulations.convergence import ConvergenceSetup, PipelineTrainer

TINY = LlamaConfig.preset("tiny")


def _state(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*shape, generator=gen) for k, shape in shapes.items()}


SHAPES = {"a.weight": (3, 4), "b.weight": (5,), "c.bias": (2, 2)}


# ---- the published formula ----------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    prev_norm=st.floats(0.0, 10.0, allow_nan=False),
    next_norm=st.floats(0.0, 10.0, allow_nan=False),
    seed=st.integers(0, 1000),
)
def test_neighbor_average_is_the_published_formula(
    prev_norm: float, next_norm: float, seed: int
) -> None:
    prev, nxt = _state(seed, SHAPES), _state(seed + 1, SHAPES)
    template = _state(seed + 2, SHAPES)
    out = neighbor_average(prev, nxt, prev_norm, next_norm, template=template)
    a, b = next_norm + 1e-4, prev_norm + 1e-4
    for key in SHAPES:
        expected = (a * nxt[key] + b * prev[key]) / (a + b)
        assert torch.equal(out[key], expected)
    w_prev, w_next = neighbor_weights(prev_norm, next_norm)
    assert w_prev == pytest.approx(b / (a + b)) and w_next == pytest.approx(a / (a + b))
    if next_norm > prev_norm:
        assert w_next >= w_prev  # the neighbour with the larger gradient gets the larger weight


@pytest.mark.parametrize(("prev_norm", "next_norm"), [(None, None), (None, 2.0), (3.0, None)])
def test_without_gradient_history_the_weights_are_equal(
    prev_norm: float | None, next_norm: float | None
) -> None:
    prev, nxt, template = _state(0, SHAPES), _state(1, SHAPES), _state(2, SHAPES)
    out = neighbor_average(prev, nxt, prev_norm, next_norm, template=template)
    for key in SHAPES:
        assert torch.equal(out[key], (nxt[key] + prev[key]) / 2)
    assert neighbor_weights(prev_norm, next_norm) == (0.5, 0.5)
    uniform = uniform_average(prev, nxt, template=template)
    assert all(torch.equal(out[k], uniform[k]) for k in SHAPES)


def test_keys_are_matched_against_the_template() -> None:
    # [Note: matching keys between stages]: both -> combined; one -> copied; neither -> template;
    # a shape mismatch counts as absent; keys the template lacks are ignored.
    template = _state(
        0, {"both": (2,), "only_prev": (2,), "only_next": (2,), "none": (2,), "odd": (3,)}
    )
    prev = {**_state(1, {"both": (2,), "only_prev": (2,), "odd": (4,)}), "extra": torch.ones(7)}
    nxt = _state(2, {"both": (2,), "only_next": (2,), "odd": (3,)})
    out = neighbor_average(prev, nxt, 1.0, 3.0, template=template)
    assert out.keys() == template.keys()
    a, b = 3.0 + 1e-4, 1.0 + 1e-4
    assert torch.equal(out["both"], (a * nxt["both"] + b * prev["both"]) / (a + b))
    assert torch.equal(out["only_prev"], prev["only_prev"])
    assert torch.equal(out["only_next"], nxt["only_next"])
    assert torch.equal(out["none"], template["none"])
    assert torch.equal(out["odd"], nxt["odd"])  # prev's has the wrong shape
    out["none"].add_(1.0)
    assert not torch.equal(out["none"], template["none"])  # results never alias inputs


def test_copy_random_and_edge_copy() -> None:
    prev, nxt, template = _state(0, SHAPES), _state(1, SHAPES), _state(2, SHAPES)
    copied = copy_neighbor(nxt, template=template)
    assert all(torch.equal(copied[k], nxt[k]) for k in SHAPES)
    fresh = random_reinit(template, prev=prev, nxt=nxt)
    assert all(torch.equal(fresh[k], template[k]) for k in SHAPES)
    shared = random_reinit(template, prev=prev, nxt=nxt, exact_keys={"b.weight"})
    assert torch.equal(shared["b.weight"], prev["b.weight"])
    # An edge stage with more blocks than its partner: the extra keys stay fresh.
    partner = {k: v for k, v in prev.items() if k != "c.bias"}
    edge = edge_copy(partner, template)
    assert torch.equal(edge["a.weight"], prev["a.weight"])
    assert torch.equal(edge["c.bias"], template["c.bias"])


def test_neighbor_weights_for_each_averaging() -> None:
    assert neighbor_weights(1.0, 2.0, "copy") == (0.0, 1.0)
    assert neighbor_weights(2.0, 1.0, "copy") == (1.0, 0.0)
    assert neighbor_weights(None, 1.0, "copy") == (1.0, 0.0)
    assert neighbor_weights(5.0, 1.0, "copy_next") == (0.0, 1.0)
    assert neighbor_weights(1.0, 5.0, "copy_prev") == (1.0, 0.0)
    assert neighbor_weights(1.0, 5.0, "uniform") == (0.5, 0.5)
    with pytest.raises(ValueError, match="no neighbour weights"):
        neighbor_weights(1.0, 1.0, "random")
    with pytest.raises(ValueError, match="prev_norm must be"):
        neighbor_weights(-1.0, 1.0)
    with pytest.raises(ValueError, match="next_norm must be"):
        neighbor_weights(1.0, float("nan"))


# ---- config and dispatch --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"averaging": "median"}, "averaging must be one of weighted, uniform"),
        ({"lr_scale": 0}, "lr_scale must be a positive number, got 0"),
        ({"lr_scale": float("inf")}, "lr_scale must be a positive number"),
        ({"eps": -1e-4}, "eps must be a positive number"),
        ({"rewarm_steps": -1}, "rewarm_steps must be a non-negative integer, got -1"),
        ({"lr_scale_steps": 0}, "lr_scale_steps must be None or a positive integer, got 0"),
        ({"reset_optimizer": "yes"}, "reset_optimizer must be a bool"),
    ],
)
def test_config_validation_names_the_bad_value(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckFreeConfig(**kwargs)  # type: ignore[arg-type]


def test_config_defaults_are_published_and_lr_factor() -> None:
    config = CheckFreeConfig()
    assert config.averaging is Averaging.WEIGHTED and config.lr_scale == 1.1
    assert config.reset_optimizer and config.rewarm_steps == 0
    assert config.lr_factor(0) == config.lr_factor(10_000) == 1.1
    ramp = CheckFreeConfig(lr_scale=1.2, rewarm_steps=3, lr_scale_steps=5)
    assert [ramp.lr_factor(k) for k in range(7)] == pytest.approx(
        [0.3, 0.6, 0.9, 1.2, 1.2, 1.0, 1.0]
    )
    assert CheckFreeConfig(averaging="copy").averaging is Averaging.COPY


def test_rebuild_stage_dispatches_and_refuses_what_checkfree_cannot_do() -> None:
    states = [_state(s, SHAPES) for s in range(4)]
    template = _state(9, SHAPES)
    config = CheckFreeConfig()
    rebuilt = rebuild_stage(
        config, stage=1, num_stages=4, template=template, prev=states[0], nxt=states[2],
        prev_norm=0.5, next_norm=2.0,
    )  # fmt: skip
    expected = neighbor_average(states[0], states[2], 0.5, 2.0, template=template)
    assert rebuilt.method == "neighbor_average"
    assert all(torch.equal(rebuilt.state[k], expected[k]) for k in SHAPES)
    assert rebuilt.weights == pytest.approx(neighbor_weights(0.5, 2.0))
    assert rebuilt.moments == {}  # fresh optimizer
    with pytest.raises(RedundancyExhausted, match="edge stage 0"):
        rebuild_stage(config, stage=0, num_stages=4, template=template, prev=None, nxt=states[1])
    with pytest.raises(RedundancyExhausted, match="neighbour 2 is lost too"):
        rebuild_stage(config, stage=1, num_stages=4, template=template, prev=states[0], nxt=None)
    edge = rebuild_stage(
        config, stage=3, num_stages=4, template=template, prev=states[2], nxt=None,
        edge_replicas=True,
    )  # fmt: skip
    assert edge.method == "edge_copy"
    assert all(torch.equal(edge.state[k], states[2][k]) for k in SHAPES)
    copy = rebuild_stage(
        CheckFreeConfig(averaging="copy"), stage=2, num_stages=4, template=template,
        prev=states[1], nxt=states[3], prev_norm=1.0, next_norm=0.1,
    )  # fmt: skip
    assert copy.method == "copy" and all(torch.equal(copy.state[k], states[1][k]) for k in SHAPES)
    with pytest.raises(ValueError, match="num_stages >= 3"):
        rebuild_stage(config, stage=1, num_stages=2, template=template, prev=None, nxt=None)


def test_rebuild_moments_fresh_or_combined() -> None:
    shapes = {"w": (3,)}

    def moments(seed: int, step: float) -> dict[str, dict[str, torch.Tensor]]:
        s = _state(seed, {"exp_avg": (3,), "exp_avg_sq": (3,)})
        return {"w": {"step": torch.tensor(step), **s}}

    prev_m, next_m = moments(0, 10.0), moments(1, 30.0)
    common = {
        "stage": 1, "num_stages": 4, "template": _state(5, shapes), "prev": _state(6, shapes),
        "nxt": _state(7, shapes), "prev_norm": 1.0, "next_norm": 3.0,
        "prev_moments": prev_m, "next_moments": next_m,
    }  # fmt: skip
    assert rebuild_stage(CheckFreeConfig(), **common).moments == {}  # type: ignore[arg-type]
    kept = rebuild_stage(CheckFreeConfig(reset_optimizer=False), **common)  # type: ignore[arg-type]
    w_prev, w_next = kept.weights
    for name in ("exp_avg", "exp_avg_sq"):
        expected = w_prev * prev_m["w"][name] + w_next * next_m["w"][name]
        assert torch.allclose(kept.moments["w"][name], expected)
    assert float(kept.moments["w"]["step"]) == 30.0


# ---- gradient-norm bookkeeping ----------------------------------------------------------------


def test_grad_norm_tracker() -> None:
    tracker = GradNormTracker(4)
    assert tracker.neighbours(1) == (None, None)
    tracker.record(0, 0.5)
    tracker.record(2, 1.0)
    assert tracker.neighbours(1) == (0.5, 1.0) and tracker.neighbours(0) == (None, None)
    before = tracker.copy()
    tracker.forget(0)
    assert tracker.last(0) is None and before.last(0) == 0.5
    with pytest.raises(ValueError, match="finite and >= 0"):
        tracker.record(1, float("inf"))
    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        tracker.last(4)
    with pytest.raises(ValueError, match="positive integer"):
        GradNormTracker(0)


def test_clip_stage_gradients_clips_shared_parameters_as_their_own_group() -> None:
    own, shared = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    own.grad = torch.tensor([3.0, 4.0])  # norm 5
    shared.grad = torch.tensor([0.3, 0.4])  # norm 0.5
    norm = clip_stage_gradients([own], [shared], max_norm=1.0, shared_is_home=True)
    assert own.grad.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(shared.grad, torch.tensor([0.3, 0.4]))  # under the limit: untouched
    assert norm == pytest.approx((1.0 + 0.25) ** 0.5)
    own.grad = torch.tensor([0.6, 0.8])
    assert clip_stage_gradients([own], [shared], shared_is_home=False) == pytest.approx(1.0)
    assert clip_stage_gradients([own], max_norm=None) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_norm must be positive"):
        clip_stage_gradients([own], max_norm=0.0)


def test_sum_shared_gradients_and_optimizer_moments_round_trip() -> None:
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.ones(3), torch.full((3,), 2.0)
    sum_shared_gradients([(a, b)])
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, torch.full((3,), 3.0)) and torch.equal(b.grad, a.grad)
    module = nn.Linear(3, 2)
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.ones(1, 3)).sum().backward()
    opt.step()
    moments = optimizer_moments(module, opt)
    assert set(moments) == {"weight", "bias"} and float(moments["weight"]["step"]) == 1.0
    other = nn.Linear(3, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    load_optimizer_moments(other, other_opt, {"weight": moments["weight"]})
    assert torch.equal(other_opt.state[other.weight]["exp_avg"], moments["weight"]["exp_avg"])
    assert not other_opt.state.get(other.bias)
    with pytest.raises(ValueError, match="unknown parameters"):
        load_optimizer_moments(other, other_opt, {"nope": {}})


# ---- CheckFree+ edge replicas in the model ----------------------------------------------------


def _edge_stages(num_stages: int, config: LlamaConfig = TINY, seed: int = 0) -> list[nn.Module]:
    stages = []
    for s in range(num_stages):
        seed_everything(seed, "init", s)
        stages.append(
            build_llama_stage(config, s, num_stages, edge_replicas=True, replica_seed=seed)
        )
    return stages


@pytest.mark.parametrize("num_stages", [4, 5, 6])
def test_edge_replicas_start_identical_and_are_named(num_stages: int) -> None:
    config = LlamaConfig.preset("tiny", n_layers=6)
    stages = _edge_stages(num_stages, config)
    S = num_stages
    sd = [s.state_dict() for s in stages]
    assert edge_replica_keys(0, S) == edge_replica_keys(1, S) == ["tok_embeddings.weight"]
    assert (
        edge_replica_keys(S - 1, S)
        == edge_replica_keys(S - 2, S)
        == ["norm.weight", "output.weight"]
    )
    assert all(edge_replica_keys(s, S) == [] for s in range(2, S - 2))
    assert (
        edge_partner(0, S) == 1 and edge_partner(S - 2, S) == S - 1 and edge_partner(2, 6) is None
    )
    assert (
        edge_replica_home(0, S) and not edge_replica_home(1, S) and not edge_replica_home(S - 2, S)
    )
    for s in range(S):
        partner = edge_partner(s, S)
        for key in edge_replica_keys(s, S):
            assert partner is not None and torch.equal(sd[s][key], sd[partner][key])
    # Holding is not acting: the natural route still runs stage 1 as a middle stage.
    assert stages[1].has_embedding and not stages[1].acts_first  # type: ignore[union-attr]
    assert stages[S - 2].has_head and not stages[S - 2].acts_last  # type: ignore[union-attr]
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    h = tokens
    for stage in stages:
        h = stage(h)
    assert h.shape == (2, 8, config.vocab_size)
    # A replica holder's blocks are those a build without replicas draws from the same seed.
    for s in (1, S - 2):
        seed_everything(0, "init", s)
        plain = build_llama_stage(config, s, S).state_dict()
        assert all(torch.equal(sd[s][k], v) for k, v in plain.items())


def test_edge_replicas_need_four_stages() -> None:
    with pytest.raises(ValueError, match="num_stages >= 4"):
        build_llama_stage(TINY, 0, 3, edge_replicas=True)
    with pytest.raises(ValueError, match="num_stages >= 4"):
        edge_replica_keys(0, 3)
    assert partition_layers(TINY, 4)  # the tiny model has one block per stage


def _trainer(plus: bool = True, **kwargs: object) -> PipelineTrainer:
    setup = ConvergenceSetup(
        preset="tiny", stages=4, microbatches=2, microbatch_size=2, max_bytes=1_000_000,
        eval_batches=1, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    return PipelineTrainer(setup, plus=plus)


def _assert_replicas_identical(trainer: PipelineTrainer) -> None:
    S = trainer.setup.stages
    for home in (0, S - 1):
        partner = edge_partner(home, S)
        assert partner is not None
        a, b = trainer.modules[home].state_dict(), trainer.modules[partner].state_dict()
        for key in edge_replica_keys(home, S):
            assert torch.equal(a[key], b[key]), f"{key} differs between stages {home}/{partner}"
        ma, mb = trainer._moments(home), trainer._moments(partner)
        for key in edge_replica_keys(home, S):
            for name in ma[key]:
                assert torch.equal(ma[key][name], mb[key][name])


def test_replicas_stay_bit_identical_through_training_and_recovery() -> None:
    trainer = _trainer()
    for step in range(3):
        trainer.train_step(step)
    _assert_replicas_identical(trainer)
    # An intermediate replica holder rebuilt with a scaled learning rate, then an edge stage
    # rebuilt from its partner: the replicas must still move in lockstep afterwards.
    trainer.rebuild([1], CheckFreeConfig(lr_scale=1.5), step=3, attempt=0)
    trainer.train_step(3)
    trainer.rebuild([3], CheckFreeConfig(), step=4, attempt=1)
    trainer.rebuild(
        [0], CheckFreeConfig(averaging="random", reset_optimizer=False), step=4, attempt=2
    )
    for step in range(4, 6):
        trainer.train_step(step)
    _assert_replicas_identical(trainer)


def test_swapped_route_training_matches_a_tied_oracle() -> None:
    """The in-process engine's math: one step with swapped routes equals running each
    microbatch through the stages in route order with the (de)embedding truly tied."""
    trainer = _trainer(clip_grad_norm=1e9, lr=1e-2, warmup_steps=0)
    S, M = 4, 2
    oracle = _edge_stages(S, trainer.config, seed=0)
    for mine, theirs in zip(trainer.modules, oracle, strict=True):
        assert all(
            torch.equal(a, b)
            for a, b in zip(mine.state_dict().values(), theirs.state_dict().values(), strict=True)
        )
    # Tie the replicas: one parameter, two users -> autograd sums the gradients.
    oracle[1].tok_embeddings = oracle[0].tok_embeddings  # type: ignore[union-attr]
    oracle[S - 2].norm, oracle[S - 2].output = oracle[S - 1].norm, oracle[S - 1].output  # type: ignore[union-attr]
    params = list(nn.ModuleList(oracle).parameters())  # unique parameters
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    routes = swapped_routes(S, M)
    assert routes[1] == (1, 0, 3, 2)
    for step in range(3):
        opt.zero_grad()
        total = 0.0
        for m in range(M):
            inputs, targets = trainer.batches.microbatch(step, 0, m)
            x = inputs
            for position, s in enumerate(routes[m]):
                x = oracle[s](x, first=position == 0, last=position == S - 1)
            loss = llama_loss(x, targets)
            (loss / M).backward()
            total += float(loss.detach())
        opt.step()
        assert trainer.train_step(step) == pytest.approx(total / M, rel=1e-6)
    for mine, theirs in zip(trainer.modules, oracle, strict=True):
        theirs_sd = theirs.state_dict()
        for key, value in mine.state_dict().items():
            torch.testing.assert_close(value, theirs_sd[key], rtol=1e-5, atol=1e-6)
