"""A small LLaMA-style decoder that is built one pipeline stage at a time.

The model is the usual pre-norm decoder: token embedding, ``n_layers`` transformer
blocks (RMSNorm, causal multi-head attention with rotary position embedding, RMSNorm,
SwiGLU feed-forward, each with a residual connection), a final RMSNorm and an untied
output head. `LlamaStage` holds one contiguous slice of it; `partition_layers` cuts the
blocks into parameter-balanced slices and `build_llama_stage` builds the slice of one
stage, so no process ever materialises the whole model. `llama_loss` is the matching
loss for the last stage's logits.

[Note: stage-local block names]
A stage keeps its blocks in ``layers`` indexed from 0, whatever their global position
(``block_range`` says which they are). Two stages with the same number of blocks
therefore have identical ``state_dict`` keys and shapes, which is what stage averaging
(CheckFree's ``neighbor_average``) and stage copying (``edge_copy``) work on: a stage
rebuilt from its neighbours is a key-by-key combination of their state dicts.

[Note: CheckFree+ edge replicas]
CheckFree+ runs odd microbatches with the first two and the last two stages swapped, so
stage 1 must be able to act first (embed tokens) and stage ``S-2`` to act last (final norm
+ head). `build_llama_stage` with ``edge_replicas=True`` gives stage 1 a replica of the
token embedding and stage ``S-2`` a replica of the final norm and output head. A stage
*holds* these modules but only *uses* them when a route puts it first / last:
``acts_first`` / ``acts_last`` (what ``forward`` does by default) stay those of its
natural position. The replicas are the same parameters as the originals and must stay
bit-identical to them: both holders draw them at construction from a generator seeded
by ``replica_seed`` alone (not by the stage's seed), and every step the runtime sums the
gradients of each tied pair across its two holders before clipping and the optimizer
step (`edge_replica_keys` names them, `edge_partner` says who holds the other copy).
Equal weights, equal gradients and equal optimizer settings then give equal updates.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallelism.checks import check_positive_int
from parallelism.seeding import derive_seed

_INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a LLaMA-style decoder.

    Raises:
        ValueError: if a size is not a positive integer, ``dim`` is not divisible by
            ``n_heads``, the head dimension is odd (rotary embedding rotates pairs), or
            ``rope_theta`` / ``norm_eps`` is not a positive finite number.
    """

    vocab_size: int = 256
    """Number of token ids; 256 is a byte-level vocabulary."""
    dim: int
    """Width of the residual stream (the hidden size)."""
    n_layers: int
    """Number of transformer blocks in the whole model (all stages together)."""
    n_heads: int
    """Number of attention heads; ``dim // n_heads`` is the head dimension and must be even."""
    ffn_dim: int | None = None
    """Hidden width of the SwiGLU feed-forward; ``None``: 8/3 * dim rounded up to a multiple of 32."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            check_positive_int(f"LlamaConfig {name}", getattr(self, name))
        if self.ffn_dim is not None:
            check_positive_int("LlamaConfig ffn_dim", self.ffn_dim)
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"LlamaConfig {name} must be a positive number, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"LlamaConfig dim={self.dim} is not divisible by n_heads={self.n_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"LlamaConfig head dimension dim/n_heads = {self.dim}/{self.n_heads} = "
                f"{self.head_dim} is odd; rotary position embedding needs an even head dimension"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named configuration, with any field overridden.

        ``"tiny"`` (~70k parameters, for tests), ``"demo"`` (~1.7M, what ``scripts/train.py``
        and the benchmarks run on 2 CPU cores), ``"small"`` (~26M) and ``"medium"`` (~85M,
        GPT-2-small sized).

        Raises:
            ValueError: for an unknown preset name or field name, or an invalid value.
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown LlamaConfig preset {name!r}; known: {', '.join(_PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown LlamaConfig field(s) {unknown}; fields: {sorted(fields)}")
        return cls(**{**_PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden width of the feed-forward: ``ffn_dim``, or its SwiGLU default."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        return -(-8 * self.dim // (3 * 32)) * 32  # ceil(8/3 * dim / 32) * 32

    def num_parameters(self) -> int:
        """Parameter count of the whole model (embedding, all blocks, final norm, head)."""
        return (
            self.embedding_parameters()
            + self.n_layers * self.block_parameters()
            + self.head_parameters()
        )

    def embedding_parameters(self) -> int:
        """Parameters of the token embedding."""
        return self.vocab_size * self.dim

    def block_parameters(self) -> int:
        """Parameters of one transformer block."""
        attention = 4 * self.dim * self.dim
        feed_forward = 3 * self.dim * self.ffn_hidden_dim
        norms = 2 * self.dim
        return attention + feed_forward + norms

    def head_parameters(self) -> int:
        """Parameters of the final norm and the output head."""
        return self.dim + self.dim * self.vocab_size


LlamaPreset = Literal["tiny", "demo", "small", "medium"]
"""A named `LlamaConfig` (`LlamaConfig.preset`)."""

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"dim": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 32},
    "demo": {"dim": 128, "n_layers": 8, "n_heads": 4, "max_seq_len": 128},
    "small": {"dim": 512, "n_layers": 8, "n_heads": 8, "max_seq_len": 256},
    "medium": {"dim": 768, "n_layers": 12, "n_heads": 12, "max_seq_len": 512},
}
assert tuple(_PRESETS) == get_args(LlamaPreset), "LlamaPreset != _PRESETS"


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 so that low-precision activations do not lose the scale.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotary_tables(config: LlamaConfig) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, each ``[max_seq_len, head_dim // 2]`` in float32."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / config.head_dim)
    )
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs of ``x`` ``[B, H, T, head_dim]`` by the angles of positions 0..T-1."""
    seq_len = x.shape[-2]
    cos, sin = cos[:seq_len], sin[:seq_len]
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embedding."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq_len, dim = x.shape
        shape = (batch, seq_len, self.n_heads, dim // self.n_heads)
        q = self.wq(x).view(shape).transpose(1, 2)
        k = self.wk(x).view(shape).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, dim))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaStage(nn.Module):
    """One contiguous slice of the model: optional token embedding, some transformer blocks,
    optional final norm + output head.

    Parameters are initialised from the current torch RNG (seed before building):
    weights ~ N(0, 0.02), the residual output projections (``wo``, ``w2``) scaled down by
    ``1/sqrt(2 * n_layers)``, norm scales 1. Blocks are named from 0 within the stage (see
    [Note: stage-local block names]); the rotary tables are non-persistent buffers.

    Args:
        config: the model's shape.
        blocks: the global indices of this stage's transformer blocks.
        embedding, head: whether the stage holds the token embedding / the final norm and
            output head.
        acts_first, acts_last: whether ``forward`` acts as the first / last stage by
            default (its natural pipeline position); default ``embedding`` / ``head``. A
            CheckFree+ replica holder holds an embedding (head) but does not act first
            (last) unless a route says so (see [Note: CheckFree+ edge replicas]).
        replica_seed: if given, the embedding and the head are drawn from generators
            seeded by it alone instead of the torch RNG, so that every holder of a
            replica starts with the same values; the blocks still come from the torch RNG.

    Raises:
        ValueError: if ``blocks`` is not a contiguous ascending range inside
            ``0..n_layers-1``, or ``acts_first`` (``acts_last``) is set without
            ``embedding`` (``head``).
    """

    tok_embeddings: nn.Embedding | None
    norm: RMSNorm | None
    output: nn.Linear | None
    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(
        self,
        config: LlamaConfig,
        blocks: range,
        *,
        embedding: bool,
        head: bool,
        acts_first: bool | None = None,
        acts_last: bool | None = None,
        replica_seed: int | None = None,
    ) -> None:
        super().__init__()
        acts_first = embedding if acts_first is None else acts_first
        acts_last = head if acts_last is None else acts_last
        if acts_first and not embedding:
            raise ValueError("acts_first=True needs embedding=True: the first stage embeds tokens")
        if acts_last and not head:
            raise ValueError("acts_last=True needs head=True: the last stage computes logits")
        if not isinstance(blocks, range) or blocks.step != 1:
            raise ValueError(f"blocks must be a range with step 1, got {blocks!r}")
        if len(blocks) and not (blocks.start >= 0 and blocks.stop <= config.n_layers):
            raise ValueError(
                f"blocks {blocks.start}..{blocks.stop - 1} outside the model's "
                f"0..{config.n_layers - 1}"
            )
        self.config = config
        self.block_range = blocks
        self.acts_first = acts_first
        self.acts_last = acts_last
        self.replica_seed = replica_seed
        # With a replica seed, building the embedding and head must not consume the torch
        # RNG, so that the blocks are drawn exactly as in a build without replicas.
        with torch.random.fork_rng(devices=[], enabled=replica_seed is not None):
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim) if embedding else None
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in blocks)
        self.norm = RMSNorm(config.dim, config.norm_eps) if head else None
        with torch.random.fork_rng(devices=[], enabled=replica_seed is not None):
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False) if head else None
        cos, sin = _rotary_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @property
    def has_embedding(self) -> bool:
        """Whether this stage holds the token embedding."""
        return self.tok_embeddings is not None

    @property
    def has_head(self) -> bool:
        """Whether this stage holds the final norm and output head."""
        return self.output is not None

    def global_name(self, name: str) -> str:
        """What ``name`` (a ``state_dict`` key of this stage) is called in the whole model:
        its blocks numbered globally (``layers.0.*`` of a stage whose blocks start at 3 is
        ``layers.3.*``), the rest as it is -- so a resume on another stage cut finds each
        tensor by name (see [Note: resharding a snapshot] in recovery/snapshots/reshard.py)."""
        head, _, rest = name.partition(".")
        index, _, tail = rest.partition(".")
        if head != "layers" or not index.isdigit():
            return name
        return f"layers.{self.block_range.start + int(index)}.{tail}"

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from the current torch RNG, in module order.

        With a ``replica_seed``, the embedding and the head come from their own generators
        seeded by it instead (see [Note: CheckFree+ edge replicas]).
        """
        residual_std = _INIT_STD / math.sqrt(2 * self.config.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(
                self.tok_embeddings.weight,
                std=_INIT_STD,
                generator=self._replica_generator("tok_embeddings"),
            )
        for block in self.layers:
            assert isinstance(block, TransformerBlock)
            attn, ffn = block.attention, block.feed_forward
            for linear in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
                nn.init.normal_(linear.weight, std=_INIT_STD)
            nn.init.normal_(attn.wo.weight, std=residual_std)
            nn.init.normal_(ffn.w2.weight, std=residual_std)
            nn.init.ones_(block.attention_norm.weight)
            nn.init.ones_(block.ffn_norm.weight)
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)
        if self.output is not None:
            nn.init.normal_(
                self.output.weight, std=_INIT_STD, generator=self._replica_generator("output")
            )

    def _replica_generator(self, name: str) -> torch.Generator | None:
        if self.replica_seed is None:
            return None
        return torch.Generator().manual_seed(derive_seed(self.replica_seed, "replica", name))

    def forward(self, x: Tensor, *, first: bool | None = None, last: bool | None = None) -> Tensor:
        """Run this slice.

        Args:
            x: token ids ``[B, T]`` (integer) if acting as the first stage, else the hidden
                state ``[B, T, dim]``.
            first: act as the first stage (embed ``x``); defaults to ``acts_first``.
            last: act as the last stage (final norm + head -> logits ``[B, T, vocab]``);
                defaults to ``acts_last``.

        Returns:
            Logits ``[B, T, vocab_size]`` if acting last, else the hidden state ``[B, T, dim]``.

        Raises:
            ValueError: if asked to act first (last) without holding the embedding (head),
                or ``x`` has the wrong shape or dtype, or ``T > max_seq_len``.
        """
        first = self.acts_first if first is None else first
        last = self.acts_last if last is None else last
        cfg = self.config
        if first:
            if self.tok_embeddings is None:
                raise ValueError(
                    f"stage with blocks {_blocks_str(self.block_range)} was asked to act as "
                    "the first stage but holds no token embedding"
                )
            if x.dim() != 2 or x.is_floating_point() or x.is_complex():
                raise ValueError(
                    f"the first stage takes integer token ids [B, T], got {x.dtype} {list(x.shape)}"
                )
            h = self.tok_embeddings(x)
        else:
            if x.dim() != 3 or x.shape[-1] != cfg.dim:
                raise ValueError(
                    f"stage with blocks {_blocks_str(self.block_range)} takes a hidden state "
                    f"[B, T, {cfg.dim}], got {list(x.shape)}"
                )
            h = x
        if h.shape[1] > cfg.max_seq_len:
            raise ValueError(f"sequence length {h.shape[1]} exceeds max_seq_len={cfg.max_seq_len}")
        for block in self.layers:
            h = block(h, self.rope_cos, self.rope_sin)
        if last:
            if self.norm is None or self.output is None:
                raise ValueError(
                    f"stage with blocks {_blocks_str(self.block_range)} was asked to act as "
                    "the last stage but holds no output head"
                )
            h = self.output(self.norm(h))
        return h

    def extra_repr(self) -> str:
        text = (
            f"blocks={_blocks_str(self.block_range)}, embedding={self.has_embedding}, "
            f"head={self.has_head}"
        )
        if self.acts_first != self.has_embedding or self.acts_last != self.has_head:
            text += f", acts_first={self.acts_first}, acts_last={self.acts_last}"
        return text


def _blocks_str(blocks: range) -> str:
    return f"{blocks.start}..{blocks.stop - 1}" if len(blocks) else "(none)"


def partition_layers(config: LlamaConfig, num_stages: int) -> list[range]:
    """Cut the transformer blocks into ``num_stages`` contiguous, non-empty, balanced ranges.

    A stage's cost is its parameter count: its blocks, plus the embedding for stage 0 and
    the final norm + head for the last stage. The partition minimises the largest stage
    cost exactly; among the partitions that reach it, it takes the one with the smallest
    sum of squared stage costs (the most even), ties broken towards earlier cuts.

    Raises:
        ValueError: if ``num_stages`` is not a positive integer or the model has fewer
            blocks than stages.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    n = config.n_layers
    if n < num_stages:
        raise ValueError(f"model has {n} blocks, fewer than {num_stages} stages")
    block, first_extra, last_extra = (
        config.block_parameters(),
        config.embedding_parameters(),
        config.head_parameters(),
    )

    def cost(start: int, stop: int, stage: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return (stop - start) * block + extra

    # Two passes of the same O(S * n^2) dynamic programme
    # over "first i blocks in k stages": the first finds the smallest achievable maximum
    # stage cost, the second the most even partition under that bound.
    limit = _partition_dp(n, num_stages, cost, lambda acc, c: max(acc, c), None)[0]
    _, cuts = _partition_dp(n, num_stages, cost, lambda acc, c: acc + c * c, limit)
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def _partition_dp(
    n: int,
    num_stages: int,
    cost: Callable[[int, int, int], int],
    combine: Callable[[int, int], int],
    limit: int | None,
) -> tuple[int, list[int]]:
    """Best value and cut points of ``n`` items in ``num_stages`` non-empty contiguous parts.

    ``combine(acc, stage_cost)`` folds a stage into the value (max or sum of squares);
    stages costing more than ``limit`` are not allowed.
    """
    # best[k][i]: best value for blocks 0..i-1 in stages 0..k-1 (None: impossible);
    # arg[k][i]: where stage k-1 starts in that best partition.
    best: list[list[int | None]] = [[None] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev is None:
                    continue
                c = cost(j, i, k - 1)
                if limit is not None and c > limit:
                    continue
                value = combine(prev, c)
                current = best[k][i]
                if current is None or value < current:
                    best[k][i], arg[k][i] = value, j
    final = best[num_stages][n]
    assert final is not None, "a partition within the optimal bound always exists"
    cuts = [n]
    for k in range(num_stages, 0, -1):
        cuts.append(arg[k][cuts[-1]])
    return final, cuts[::-1]


def build_llama_stage(
    config: LlamaConfig,
    stage: int,
    num_stages: int,
    *,
    edge_replicas: bool = False,
    replica_seed: int = 0,
) -> LlamaStage:
    """Build stage ``stage`` of ``num_stages``: the embedding iff first, the head iff last.

    With ``edge_replicas`` (CheckFree+, ``num_stages >= 4``), stage 1 also holds a replica
    of the token embedding and stage ``num_stages - 2`` a replica of the final norm and
    head; every holder of the embedding or head then draws it from ``replica_seed`` so
    the copies start bit-identical (see [Note: CheckFree+ edge replicas]). The blocks
    always come from the torch RNG.

    Raises:
        ValueError: if ``stage`` is outside ``0..num_stages-1``, the model cannot be cut
            into ``num_stages`` stages (see `partition_layers`), or ``edge_replicas`` is
            asked for with fewer than 4 stages.
    """
    ranges = partition_layers(config, num_stages)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage!r} outside 0..{num_stages - 1}")
    first, last = stage == 0, stage == num_stages - 1
    if not edge_replicas:
        return LlamaStage(config, ranges[stage], embedding=first, head=last)
    _check_edge_stages(num_stages)
    return LlamaStage(
        config,
        ranges[stage],
        embedding=stage in (0, 1),
        head=stage in (num_stages - 2, num_stages - 1),
        acts_first=first,
        acts_last=last,
        replica_seed=replica_seed,
    )


_EMBEDDING_KEYS = ("tok_embeddings.weight",)
_HEAD_KEYS = ("norm.weight", "output.weight")


def _check_edge_stages(num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 4:
        raise ValueError(
            f"CheckFree+ edge replicas need num_stages >= 4 (the first and the last pair of "
            f"stages must be distinct), got num_stages={num_stages!r}"
        )


def edge_partner(stage: int, num_stages: int) -> int | None:
    """The CheckFree+ swap partner of ``stage``: 0 <-> 1 and ``S-1`` <-> ``S-2``, else ``None``.

    The partner acts in the stage's position on swapped routes, holds the replica of its
    (de)embedding and is the source `edge_copy` rebuilds an edge stage from.

    Raises:
        ValueError: if ``num_stages < 4`` or ``stage`` is outside ``0..num_stages-1``.
    """
    _check_edge_stages(num_stages)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage!r} outside 0..{num_stages - 1}")
    return {0: 1, 1: 0, num_stages - 2: num_stages - 1, num_stages - 1: num_stages - 2}.get(stage)


def edge_replica_keys(stage: int, num_stages: int) -> list[str]:
    """State-dict keys that ``stage`` shares bit-identically with its `edge_partner`.

    Stages 0 and 1 share the token embedding, stages ``S-2`` and ``S-1`` the final norm and
    output head; the other stages share nothing. The runtime sums the gradients of these
    parameters over the two holders every step (see [Note: CheckFree+ edge replicas]).
    The copy on stage 0 / ``S-1`` is the *home* copy: it is part of that stage's own
    gradient norm; the copy on stage 1 / ``S-2`` is the replica.

    Raises:
        ValueError: if ``num_stages < 4`` or ``stage`` is outside ``0..num_stages-1``.
    """
    partner = edge_partner(stage, num_stages)
    if partner is None:
        return []
    return list(_EMBEDDING_KEYS if min(stage, partner) == 0 else _HEAD_KEYS)


def edge_replica_home(stage: int, num_stages: int) -> bool:
    """Whether ``stage`` is the home (not the replica) holder of its shared keys.

    True for stages 0 and ``S-1`` (and for stages without shared keys, vacuously).

    Raises:
        ValueError: if ``num_stages < 4`` or ``stage`` is outside ``0..num_stages-1``.
    """
    partner = edge_partner(stage, num_stages)
    return partner is None or stage in (0, num_stages - 1)


def llama_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over every position of every sequence.

    Raises:
        ValueError: if ``logits`` is not ``targets.shape + [vocab]``.
    """
    if logits.dim() != targets.dim() + 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {list(logits.shape)} do not match targets {list(targets.shape)}; "
            "expected logits [..., vocab] with targets [...]"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
