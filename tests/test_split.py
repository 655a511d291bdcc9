"""`TrainSpec.from_module`: the user's whole model, split by torch pipelining, trains as the
unsplit model does and recovers exactly; a model that cannot be split is refused early."""

from __future__ import annotations

import functools
import itertools
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from parallelism import Topology
from parallelism.seeding import seed_everything
from parallelism.split import ModelSplit, _min_max_partition, balanced_split_points
from recovery import Kill, RecoveryPolicy, Trainer, TrainSpec, batches_from_dataset
from recovery.runtime.membership import Membership
from tests.jobs import drive, make
from tests.test_controller import assert_equal_states
from tests.workloads import TinyLM, TokenSequences, adamw, lm_loss

MICROBATCHES = 2
PER_REPLICA = 4  # samples per replica per step: 2 microbatches of 2
EXAMPLE = torch.zeros(PER_REPLICA // MICROBATCHES, 8, dtype=torch.long)
LOSS_RTOL = 1e-6
"""Losses of the split job against the unsplit model in one process: the same operations
on the same numbers, summed in another order (microbatch losses per replica, then the
replica average)."""


def lm_spec(**overrides: object) -> TrainSpec:
    kwargs: dict[str, object] = dict(
        example_input=EXAMPLE,
        loss_fn=lm_loss,
        make_optimizer=adamw,
        batches=batches_from_dataset(TokenSequences(), PER_REPLICA),
        microbatches=MICROBATCHES,
    )
    kwargs.update(overrides)
    return TrainSpec.from_module(TinyLM, **kwargs)  # type: ignore[arg-type]


def unsplit_losses(spec: TrainSpec, replicas: int, steps: int) -> list[float]:
    """Single-process training of the whole model on the same global batches."""
    seed_everything(spec.seed, "model")
    model = TinyLM()
    optimizer = spec.make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(replicas):
            inputs, targets = spec.batches(step, r, replicas)  # type: ignore[misc]
            for x, y in zip(inputs.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True):
                loss = spec.loss_fn(model(x), y) / (MICROBATCHES * replicas)
                loss.backward()
                total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize(("stages", "replicas"), [(2, 2), (4, 1)])
def test_the_split_model_trains_like_the_unsplit_one(stages: int, replicas: int) -> None:
    spec = lm_spec()
    spec.check(Topology(stages, replicas))
    controller, _ = make(spec, Topology(stages, replicas), steps=4)
    drive(controller)
    losses = [r.loss for r in controller.records]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(unsplit_losses(spec, replicas, 4), dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )


def test_a_killed_worker_of_a_split_model_is_rebuilt_exactly() -> None:
    spec, top = lm_spec(), Topology(2, 2)
    clean, _ = make(spec, top)
    drive(clean)
    controller, _ = make(spec, top, Kill(step=2, stage=1, replica=0))
    drive(controller)
    assert [e.strategy for e in controller.events] == ["replica_copy"]
    assert_equal_states(controller.final_states, clean.final_states)  # type: ignore[attr-defined]


def test_stages_keep_the_models_own_parameter_names_and_weights() -> None:
    split = ModelSplit(make_model=TinyLM, example_input=EXAMPLE, split_points=("blocks.2",))
    model, stages = split.stages(2)
    assert split.check(2) == ["blocks.2"]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    assert names[0] == "embed.weight" and names[-1] == "head.weight"
    # Built from the job's seed: every worker's copy of a stage is the same.
    again = pickle.loads(pickle.dumps(split))(1, 2)
    for (n, a), (_, b) in zip(stages[1].named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_balanced_split_points_weigh_the_embedding_and_the_head() -> None:
    model = TinyLM(vocab=32, dim=16, blocks=4)
    assert balanced_split_points(model, 1) == []
    assert balanced_split_points(model, 2) == ["blocks.2"]
    assert balanced_split_points(model, 4) == ["blocks.1", "blocks.2", "blocks.3"]
    # A large embedding and head at both ends: still half the blocks each.
    assert balanced_split_points(TinyLM(vocab=4096, dim=16, blocks=6), 2) == ["blocks.3"]
    # One heavy block gets a stage of its own.
    mlp = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)), nn.Linear(16, 1600))
    assert balanced_split_points(mlp, 2) == ["3"]
    assert balanced_split_points(mlp, 3)[-1] == "3"


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=8), data=st.data())
def test_the_partition_minimises_the_largest_run(sizes: list[int], data: st.DataObject) -> None:
    parts = data.draw(st.integers(1, len(sizes)))
    starts = _min_max_partition(sizes, parts)
    assert starts[0] == 0 and len(starts) == parts and starts == sorted(set(starts))

    def worst(cut: tuple[int, ...]) -> int:
        bounds = [*cut, len(sizes)]
        return max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))

    best = min(worst((0, *c)) for c in itertools.combinations(range(1, len(sizes)), parts - 1))
    assert worst(tuple(starts)) == best


class Untraceable(TinyLM):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
            x = x * 2
        return self.head(x)


class Headless(nn.Module):
    """Its last stage returns a tuple, not the loss function's input."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM()

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm(tokens)
        return logits, logits.mean()


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker was started for bad input")

    monkeypatch.setattr(Membership, "start", refuse)
    monkeypatch.setattr(Membership, "start_job", refuse)
    monkeypatch.setattr("recovery.groups.ray_group.connect", refuse)


@pytest.mark.parametrize(
    ("overrides", "stages", "message"),
    [
        (
            dict(make_model=Untraceable),
            2,
            r"could not trace it.* failed in Untraceable at .*test_split.py:\d+: if x.sum\(\) > 0",
        ),
        (dict(split_points=["blocks.9"]), 2, r"split point 'blocks.9' names no module of TinyLM"),
        (dict(split_points=["blocks.1", "blocks.3"]), 2, r"2 split points make 3 stages"),
        (dict(make_model=functools.partial(TinyLM, tied=True)), 2, r"tied across stages: "),
        (dict(), 5, r"into 5 stages: it has 4 blocks"),
        (dict(split_points=["embed"]), 2, r"stage 0 of 2 \(split points \['embed'\]\) has no"),
        (dict(num_stages=3), 2, r"num_stages=3, but the job has 2"),
        (dict(make_model=Headless, split_points=["lm.blocks.2"]), 2, r"must return one tensor"),
        (dict(example_input=EXAMPLE[:1]), 2, r"traced for microbatches of shape \(1, 8\)"),
    ],
    ids=[
        "untraceable",
        "no-such-module",
        "too-many-points",
        "tied",
        "more-stages-than-blocks",
        "empty-stage",
        "num-stages",
        "tuple-output",
        "shape",
    ],
)
@pytest.mark.usefixtures("no_workers")
def test_a_model_that_cannot_be_split_is_refused_before_any_worker(
    overrides: dict[str, object], stages: int, message: str
) -> None:
    make_model = overrides.pop("make_model", TinyLM)
    kwargs: dict[str, object] = dict(
        example_input=EXAMPLE,
        loss_fn=lm_loss,
        make_optimizer=adamw,
        batches=batches_from_dataset(TokenSequences(), PER_REPLICA),
        microbatches=MICROBATCHES,
    )
    kwargs.update(overrides)
    spec = TrainSpec.from_module(make_model, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        Trainer(spec, topology=Topology(stages, 1), policy=RecoveryPolicy()).fit(1)


def test_split_points_and_num_stages_are_exclusive() -> None:
    with pytest.raises(ValueError, match="not both"):
        lm_spec(split_points=["blocks.2"], num_stages=2)


class GPT2Logits(nn.Module):
    """A Hugging Face GPT-2 with random weights (nothing downloaded), untied, eager
    attention; returns the logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=32,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            tie_word_embeddings=False,
            resid_pdrop=0.0,  # dropout would draw other numbers in the split model
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        config._attn_implementation = "eager"
        self.gpt2 = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=tokens, use_cache=False).logits


def test_hugging_face_gpt2_splits_and_trains_like_the_unsplit_model() -> None:
    pytest.importorskip("transformers", reason="the optional extra: pip install -e '.[hf]'")
    spec = TrainSpec.from_module(
        GPT2Logits,
        example_input=EXAMPLE,
        loss_fn=lm_loss,
        make_optimizer=adamw,
        batches=batches_from_dataset(TokenSequences(), PER_REPLICA),
        microbatches=MICROBATCHES,
    )
    top = Topology(2, 1)
    assert spec.check_stages is not None and spec.check_stages(2) == ["gpt2.transformer.h.1"]
    controller, _ = make(spec, top, steps=3)
    drive(controller)
    seed_everything(spec.seed, "model")
    model = GPT2Logits()
    optimizer = spec.make_optimizer(model.parameters())
    expected = []
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = spec.batches(step, 0, 1)  # type: ignore[misc]
        total = 0.0
        for x, y in zip(inputs.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True):
            loss = lm_loss(model(x), y) / MICROBATCHES
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        expected.append(total)
    torch.testing.assert_close(
        torch.tensor([r.loss for r in controller.records], dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
