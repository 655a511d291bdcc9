"""`RecoveryPolicy` takes each knob by one spelling: the flat names of earlier versions are
refused naming their home, in Python and in an experiment's TOML alike; every choice
among fixed strings is checked against its ``Literal``; flags are booleans, not strings."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_args

import pytest

from recovery import CheckFreeConfig, MirrorPolicy, SnapshotPolicy, Timeouts
from recovery.policy import (
    APPROXIMATIONS,
    MODES,
    RENAMED,
    STRATEGY_NAMES,
    Approximation,
    RecoveryPolicy,
)
from simulations.experiments import runtime_cells


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_every_flat_name_is_refused_naming_its_home(old: str) -> None:
    home = RENAMED[old]
    part, attr = home.split(".")
    with pytest.raises(ValueError, match="renamed key") as info:
        RecoveryPolicy(**{old: 1})
    text = str(info.value)
    assert f"{old!r} is now {home!r}" in text and f"{part}=" in text and f"({attr}=...)" in text


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_every_home_is_a_field_of_a_part(old: str) -> None:
    part, attr = RENAMED[old].split(".")
    assert attr in {f.name for f in dataclasses.fields(getattr(RecoveryPolicy(), part))}


def test_an_experiment_table_is_refused_the_same_way() -> None:
    data = {"rates": [0.1], "policies": {"restart": {"checkpoint_every": 20}}}
    with pytest.raises(ValueError, match=r"policies\.restart: renamed key") as info:
        runtime_cells(data)
    assert "'checkpoint_every' is now 'baseline.checkpoint_every'" in str(info.value)
    nested = {"rates": [0.1], "policies": {"restart": {"baseline": {"checkpoint_every": 20}}}}
    assert len(runtime_cells(nested)) == 1


def test_the_shipped_experiment_files_use_the_new_spelling() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[1] / "configs"
    for path in root.glob("runtime*.toml"):
        runtime_cells(tomllib.loads(path.read_text()))


def test_a_part_may_be_a_mapping_of_its_fields() -> None:
    policy = RecoveryPolicy(
        snapshots={"peer_every": 5, "durable_every": 10},
        mirrors={"every": 3},
        timeouts={"hang": 7},
        checkfree={"lr_scale": 1.2},
    )
    assert policy.snapshots == SnapshotPolicy(peer_every=5, durable_every=10)
    assert policy.mirrors == MirrorPolicy(every=3)
    assert policy.timeouts == Timeouts(hang=7)
    assert policy.checkfree == CheckFreeConfig(lr_scale=1.2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"checkfree": {"lr_scales": 1.2}},
            r"unknown key\(s\) \['lr_scales'\] in checkfree; .*lr_scale",
        ),
        ({"snapshots": {"every": 5}}, r"unknown key\(s\) \['every'\] in snapshots; .*peer_every"),
        ({"timeouts": 5}, "timeouts must be a Timeouts or a mapping of its fields"),
        ({"snapshot": 5}, r"unknown keyword arguments \['snapshot'\]; its fields are .*snapshots"),
    ],
)
def test_unknown_keys_are_refused_naming_the_known_ones(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        RecoveryPolicy(**kwargs)


@pytest.mark.parametrize("flag", ["exact_only", "elastic"])
@pytest.mark.parametrize("value", ["no", "false", "False", 0, 1, None])
def test_a_flag_is_a_bool_not_a_string(flag: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{flag} must be True or False, got {value!r}"):
        RecoveryPolicy(**{flag: value})


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"strategy": "rebuild"}, MODES),
        ({"approximate": "checkfree++"}, get_args(Approximation)),
        ({"mirrors": {"embedding": "some"}}, ("partial", "exact")),
    ],
)
def test_a_choice_is_refused_listing_the_allowed_values(
    kwargs: dict[str, object], allowed: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match="must be one of") as info:
        RecoveryPolicy(**kwargs)
    assert all(repr(value) in str(info.value) for value in allowed)


def test_the_literals_match_the_checked_values() -> None:
    assert (None, *get_args(Approximation)) == APPROXIMATIONS
    assert "restart" not in STRATEGY_NAMES and "replica_copy" in STRATEGY_NAMES


def test_allowed_is_a_collection_of_names_and_one_name_is_one_name() -> None:
    assert RecoveryPolicy(allowed="replica_copy").allowed == ("replica_copy",)
    assert RecoveryPolicy(allowed=["rollback", "replica_copy"]).allowed == (
        "rollback",
        "replica_copy",
    )
    with pytest.raises(ValueError, match=r"unknown strategies \['r'\]"):
        RecoveryPolicy(allowed=("r",))
    with pytest.raises(ValueError, match=r"unknown strategies \['restart'\]"):
        RecoveryPolicy(allowed=("restart",))
    with pytest.raises(ValueError, match="collection of strategy names"):
        RecoveryPolicy(allowed=3)


def test_a_policy_is_hashable_and_replace_keeps_its_parts() -> None:
    policy = RecoveryPolicy(allowed=["rollback"], snapshots={"peer_every": 3})
    hash(policy)
    again = dataclasses.replace(policy, hot_spares=1)
    assert again.snapshots == policy.snapshots and again.allowed == ("rollback",)
