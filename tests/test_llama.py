"""Tests of the pipeline-stageable LLaMA-style decoder in `parallelism.workloads.llama`."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from parallelism.workloads.llama import (
    LlamaConfig,
    LlamaStage,
    TransformerBlock,
    build_llama_stage,
    llama_loss,
    partition_layers,
)

TINY = LlamaConfig.preset("tiny")


def _tokens(config: LlamaConfig, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)


def _build_stages(config: LlamaConfig, num_stages: int, seed: int = 0) -> list[LlamaStage]:
    stages = []
    for s in range(num_stages):
        torch.manual_seed(seed + s)
        stages.append(build_llama_stage(config, s, num_stages))
    return stages


# ---- config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("tiny", 50_000, 150_000),
        ("demo", 1_500_000, 2_000_000),
        ("small", 25_000_000, 30_000_000),
        ("medium", 85_000_000, 100_000_000),
    ],
)
def test_preset_parameter_counts_in_stated_range(name: str, low: int, high: int) -> None:
    assert low <= LlamaConfig.preset(name).num_parameters() <= high


def test_preset_overrides_and_unknown_names() -> None:
    cfg = LlamaConfig.preset("tiny", n_layers=6, vocab_size=512)
    assert (cfg.n_layers, cfg.vocab_size, cfg.dim) == (6, 512, 32)
    with pytest.raises(
        ValueError, match=r"unknown LlamaConfig preset 'huge'.*tiny, demo, small, medium"
    ):
        LlamaConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        LlamaConfig.preset("tiny", layers=3)


def test_default_ffn_dim_is_swiglu_rounded_to_32() -> None:
    assert LlamaConfig(dim=32, n_layers=1, n_heads=4).ffn_hidden_dim == 96  # 85.3 -> 96
    assert LlamaConfig(dim=768, n_layers=1, n_heads=12).ffn_hidden_dim == 2048
    assert LlamaConfig(dim=32, n_layers=1, n_heads=4, ffn_dim=40).ffn_hidden_dim == 40


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 30, "n_heads": 4}, "dim=30 is not divisible by n_heads=4"),
        ({"dim": 12, "n_heads": 4}, "head dimension .* = 3 is odd"),
        ({"dim": 0}, "dim must be a positive integer, got 0"),
        ({"n_layers": -1}, "n_layers must be a positive integer, got -1"),
        ({"n_heads": 0}, "n_heads must be a positive integer, got 0"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"max_seq_len": 0}, "max_seq_len must be a positive integer"),
        ({"ffn_dim": 0}, "ffn_dim must be a positive integer"),
        ({"dim": 32.0}, "dim must be a positive integer, got 32.0"),
        ({"rope_theta": 0.0}, "rope_theta must be a positive number"),
        ({"norm_eps": float("nan")}, "norm_eps must be a positive number"),
    ],
)
def test_bad_config_raises_value_error(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"dim": 32, "n_layers": 2, "n_heads": 4}
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**base, **kwargs})  # type: ignore[arg-type]


# ---- partition -------------------------------------------------------------------------


def _cost(config: LlamaConfig, ranges: list[range]) -> list[int]:
    costs = [len(r) * config.block_parameters() for r in ranges]
    costs[0] += config.embedding_parameters()
    costs[-1] += config.head_parameters()
    return costs


def _brute_force_min_max(config: LlamaConfig, num_stages: int) -> int:
    n = config.n_layers
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        ranges = [range(a, b) for a, b in itertools.pairwise(bounds)]
        worst = max(_cost(config, ranges))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@settings(max_examples=60, deadline=None)
@given(
    n_layers=st.integers(1, 9),
    stages=st.integers(1, 9),
    dim=st.sampled_from([8, 16, 32]),
    vocab=st.sampled_from([2, 64, 256, 4096]),
)
def test_partition_is_exactly_balanced(n_layers: int, stages: int, dim: int, vocab: int) -> None:
    cfg = LlamaConfig(dim=dim, n_layers=n_layers, n_heads=2, vocab_size=vocab)
    if stages > n_layers:
        with pytest.raises(ValueError, match=f"model has {n_layers} blocks, fewer than {stages}"):
            partition_layers(cfg, stages)
        return
    ranges = partition_layers(cfg, stages)
    assert len(ranges) == stages
    assert all(len(r) > 0 and r.step == 1 for r in ranges)
    assert ranges[0].start == 0 and ranges[-1].stop == n_layers
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    assert max(_cost(cfg, ranges)) == _brute_force_min_max(cfg, stages)


def test_partition_prefers_even_split_and_rejects_bad_stage_counts() -> None:
    assert [len(r) for r in partition_layers(LlamaConfig.preset("small"), 4)] == [2, 2, 2, 2]
    # Embedding and head are heavy relative to a block here, so the edges get fewer blocks.
    assert [len(r) for r in partition_layers(TINY, 3)] == [1, 2, 1]
    with pytest.raises(ValueError, match="num_stages must be a positive integer"):
        partition_layers(TINY, 0)
    with pytest.raises(ValueError, match=r"stage 4 outside 0\.\.3"):
        build_llama_stage(TINY, 4, 4)


# ---- stages ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_stage_parameters_add_up_to_the_model(num_stages: int) -> None:
    stages = _build_stages(TINY, num_stages)
    total = sum(p.numel() for stage in stages for p in stage.parameters())
    assert total == TINY.num_parameters()
    assert stages[0].has_embedding and stages[-1].has_head
    assert [s.block_range for s in stages] == partition_layers(TINY, num_stages)
    assert sum(s.has_embedding for s in stages) == 1 and sum(s.has_head for s in stages) == 1


def _unsplit_state(stages: list[LlamaStage]) -> dict[str, torch.Tensor]:
    """The stages' parameters under the names of one stage holding the whole model: stage-local
    block ``layers.i`` is global block ``block_range.start + i``."""
    state: dict[str, torch.Tensor] = {}
    for stage in stages:
        for key, value in stage.state_dict().items():
            if key.startswith("layers."):
                _, local, rest = key.split(".", 2)
                key = f"layers.{stage.block_range.start + int(local)}.{rest}"
            assert key not in state, key
            state[key] = value
    return state


def _reference_logits(
    cfg: LlamaConfig, w: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    """LLaMA written out from its definition in float64 (pre-norm RMSNorm blocks, rotary on
    consecutive pairs, causal softmax attention, SwiGLU), sharing no code with the module."""
    w = {k: v.double() for k, v in w.items()}
    batch, seq = tokens.shape
    heads, hd = cfg.n_heads, cfg.head_dim

    def rms(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * scale

    freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(
        torch.ones(seq, hd // 2, dtype=torch.float64), torch.outer(torch.arange(seq), freq)
    )

    def rope(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, hd]
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)

    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = w["tok_embeddings.weight"][tokens]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        a = rms(x, w[p + "attention_norm.weight"])
        q, k, v = (
            (a @ w[p + f"attention.w{n}.weight"].T).view(batch, seq, heads, hd).transpose(1, 2)
            for n in "qkv"
        )
        scores = (rope(q) @ rope(k).transpose(-1, -2)) / math.sqrt(hd)
        attn = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v
        x = x + attn.transpose(1, 2).reshape(batch, seq, cfg.dim) @ w[p + "attention.wo.weight"].T
        f = rms(x, w[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(f @ w[p + "feed_forward.w1.weight"].T)
        x = x + (gate * (f @ w[p + "feed_forward.w3.weight"].T)) @ w[p + "feed_forward.w2.weight"].T
    return rms(x, w["norm.weight"]) @ w["output.weight"].T


def test_chained_stages_equal_the_unsplit_model_and_give_logits() -> None:
    cfg = LlamaConfig.preset("tiny", n_layers=5)
    stages = _build_stages(cfg, 3, seed=7)
    assert [len(s.block_range) for s in stages] == [2, 2, 1]  # stages of several blocks
    tokens = _tokens(cfg)
    h = tokens
    for stage in stages:
        h = stage(h)
    assert h.shape == (2, 16, cfg.vocab_size)
    assert stages[1](stages[0](tokens)).shape == (2, 16, cfg.dim)
    # The oracle: the whole model in one stage with the same weights, forward and backward.
    whole = LlamaStage(cfg, range(cfg.n_layers), embedding=True, head=True)
    whole.load_state_dict(_unsplit_state(stages), strict=True)
    logits = whole(tokens)
    assert torch.equal(h, logits)
    targets = _tokens(cfg, seed=1)
    llama_loss(h, targets).backward()
    llama_loss(logits, targets).backward()
    split_grads = {k: v.grad for k, v in _unsplit_params(stages).items()}
    for key, param in whole.named_parameters():
        assert split_grads[key] is not None and param.grad is not None, key
        assert torch.equal(split_grads[key], param.grad), key
    # ...and the unsplit model is LLaMA as written out independently.
    torch.testing.assert_close(
        logits.double(), _reference_logits(cfg, _unsplit_state(stages), tokens), rtol=0, atol=1e-5
    )


def _unsplit_params(stages: list[LlamaStage]) -> dict[str, nn.Parameter]:
    params: dict[str, nn.Parameter] = {}
    for stage in stages:
        for key, param in stage.named_parameters():
            if key.startswith("layers."):
                _, local, rest = key.split(".", 2)
                key = f"layers.{stage.block_range.start + int(local)}.{rest}"
            params[key] = param
    return params


def test_build_is_deterministic_under_the_torch_seed() -> None:
    a, b = _build_stages(TINY, 2, seed=3), _build_stages(TINY, 2, seed=3)
    for sa, sb in zip(a, b, strict=True):
        sda, sdb = sa.state_dict(), sb.state_dict()
        assert sda.keys() == sdb.keys()
        assert all(torch.equal(sda[k], sdb[k]) for k in sda)
    c = _build_stages(TINY, 2, seed=4)
    assert not torch.equal(a[0].tok_embeddings.weight, c[0].tok_embeddings.weight)  # type: ignore[union-attr]


def test_initialisation_statistics_and_buffers() -> None:
    cfg = LlamaConfig(dim=256, n_layers=8, n_heads=4, vocab_size=512)
    torch.manual_seed(0)
    stage = LlamaStage(cfg, range(1), embedding=True, head=True)
    block = stage.layers[0]
    assert isinstance(block, TransformerBlock)
    assert abs(stage.tok_embeddings.weight.std().item() - 0.02) < 2e-3  # type: ignore[union-attr]
    assert abs(block.attention.wq.weight.std().item() - 0.02) < 2e-3
    assert abs(block.attention.wo.weight.std().item() - 0.02 / 4) < 5e-4  # 1/sqrt(2*8)
    assert abs(block.feed_forward.w2.weight.std().item() - 0.02 / 4) < 5e-4
    assert torch.equal(block.attention_norm.weight, torch.ones(256))
    assert torch.equal(stage.norm.weight, torch.ones(256))  # type: ignore[union-attr]
    # Rotary tables are rebuilt from the config, never saved.
    assert not any("rope" in key for key in stage.state_dict())


def test_middle_stages_with_equal_block_counts_share_state_dict_keys() -> None:
    stages = _build_stages(LlamaConfig.preset("tiny", n_layers=6), 4)
    assert [len(s.block_range) for s in stages[1:3]] == [2, 2]
    assert stages[1].state_dict().keys() == stages[2].state_dict().keys()


def test_first_and_last_overrides() -> None:
    torch.manual_seed(0)
    both = LlamaStage(TINY, range(1, 3), embedding=True, head=True)
    tokens = _tokens(TINY)
    hidden = both(tokens, last=False)
    assert hidden.shape == (2, 16, TINY.dim)
    assert both(hidden, first=False).shape == (2, 16, TINY.vocab_size)
    assert torch.equal(both(tokens, first=True, last=True), both(tokens))
    middle = LlamaStage(TINY, range(1, 3), embedding=False, head=False)
    with pytest.raises(ValueError, match="first stage but holds no token embedding"):
        middle(tokens, first=True)
    with pytest.raises(ValueError, match="last stage but holds no output head"):
        middle(hidden, last=True)


def test_bad_inputs_and_ranges_raise_value_error() -> None:
    torch.manual_seed(0)
    first = LlamaStage(TINY, range(2), embedding=True, head=False)
    with pytest.raises(ValueError, match="integer token ids"):
        first(torch.zeros(2, 4, TINY.dim))
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        first(torch.zeros(1, 33, dtype=torch.long))
    middle = LlamaStage(TINY, range(2, 3), embedding=False, head=False)
    with pytest.raises(ValueError, match=r"takes a hidden state \[B, T, 32\]"):
        middle(torch.zeros(2, 4, 16))
    with pytest.raises(ValueError, match=r"outside the model's 0\.\.3"):
        LlamaStage(TINY, range(3, 5), embedding=False, head=False)
    with pytest.raises(ValueError, match="step 1"):
        LlamaStage(TINY, range(0, 4, 2), embedding=False, head=False)


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = LlamaStage(TINY, range(TINY.n_layers), embedding=True, head=True)
    tokens = _tokens(TINY, batch=1)
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % TINY.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_loss_shape_checks_and_initial_value() -> None:
    logits = torch.zeros(2, 5, 7)
    targets = torch.zeros(2, 5, dtype=torch.long)
    assert torch.isclose(llama_loss(logits, targets), torch.log(torch.tensor(7.0)))
    with pytest.raises(ValueError, match="do not match targets"):
        llama_loss(logits, torch.zeros(2, 4, dtype=torch.long))


def test_tiny_model_learns_a_fixed_batch() -> None:
    stages = _build_stages(TINY, 2)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    batch = _tokens(TINY, batch=4, seq_len=TINY.max_seq_len + 1, seed=1)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(30):
        loss = llama_loss(stages[1](stages[0](inputs)), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.2
    assert losses[-1] < losses[0] - 0.5
