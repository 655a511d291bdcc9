"""Tests for simulations.traces: failure models draw what they claim, traces replay, bad input fails.

Statistical checks use fixed seeds and tolerances of at least four standard errors.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulations.traces import (
    LLAMA3_DAYS,
    LLAMA3_GPU_MTBF_HOURS,
    LLAMA3_GPUS,
    LLAMA3_INTERRUPTIONS,
    ClusterShape,
    ExponentialFailures,
    FailureEvents,
    MixedFailures,
    TraceReplay,
    WeibullFailures,
    llama3_failures,
)

HOUR = 3600.0
DAY = 86400.0


def test_cluster_shape_groups_contiguous_gpus() -> None:
    shape = ClusterShape(gpus=20, gpus_per_node=8, nodes_per_rack=2)
    assert (shape.nodes, shape.racks) == (3, 2)
    first, width = shape.span(np.array([0, 1, 1, 2, 2]), np.array([19, 0, 2, 0, 1]))
    assert first.tolist() == [19, 0, 16, 0, 16]
    assert width.tolist() == [1, 8, 4, 16, 4]  # the last node and rack are partial


@pytest.mark.parametrize(
    "kwargs", [{"gpus": 0}, {"gpus": 8, "gpus_per_node": 0}, {"gpus": 2.5}, {"gpus": True}]
)
def test_cluster_shape_rejects_bad_counts(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="ClusterShape"):
        ClusterShape(**kwargs)


def test_exponential_count_matches_rate_and_events_are_sorted() -> None:
    shape = ClusterShape(gpus=4096)
    model = ExponentialFailures(mtbf_hours=20_000.0)
    horizon = 30 * DAY
    events = model.sample(shape, horizon, seeds=200, seed=3)
    expected = model.expected_events(shape, horizon)
    assert expected == pytest.approx(4096 * 720 / 20_000)
    counts = events.counts()
    assert abs(counts.mean() - expected) < 4 * math.sqrt(expected / 200)
    key = events.seed * 2 * horizon + events.time_s
    assert np.all(np.diff(key) >= 0)
    assert np.all(events.num_gpus == 1) and events.time_s.max() < horizon


def test_seed_streams_do_not_depend_on_how_many_seeds_are_drawn() -> None:
    shape = ClusterShape(gpus=512)
    model = llama3_failures()
    many = model.sample(shape, 200 * DAY, seeds=10, seed=5)
    few = model.sample(shape, 200 * DAY, seeds=3, seed=5, first_seed=7)
    for i in range(3):
        a = slice(many.offsets[7 + i], many.offsets[8 + i])
        b = slice(few.offsets[i], few.offsets[i + 1])
        assert np.array_equal(many.time_s[a], few.time_s[b])
        assert np.array_equal(many.first_gpu[a], few.first_gpu[b])


def test_node_and_rack_failures_take_whole_components() -> None:
    shape = ClusterShape(gpus=64, gpus_per_node=8, nodes_per_rack=2)
    node = ExponentialFailures(mtbf_hours=100.0, component="node").sample(shape, 100 * DAY, seeds=2)
    assert len(node) > 0 and np.all(node.num_gpus == 8) and np.all(node.first_gpu % 8 == 0)
    rack = ExponentialFailures(mtbf_hours=100.0, component="rack").sample(shape, 100 * DAY, seeds=2)
    assert len(rack) > 0 and np.all(rack.num_gpus == 16) and np.all(rack.first_gpu % 16 == 0)


def test_llama3_preset_reproduces_419_interruptions() -> None:
    shape = ClusterShape(gpus=LLAMA3_GPUS)
    horizon = LLAMA3_DAYS * DAY
    assert pytest.approx(50_676, rel=1e-4) == LLAMA3_GPU_MTBF_HOURS
    for correlated in (False, True):
        model = llama3_failures(correlated=correlated)
        assert model.expected_events(shape, horizon) == pytest.approx(LLAMA3_INTERRUPTIONS)
        counts = model.sample(shape, horizon, seeds=100).counts()
        assert abs(counts.mean() - LLAMA3_INTERRUPTIONS) < 4 * math.sqrt(LLAMA3_INTERRUPTIONS / 100)
    events = llama3_failures().sample(shape, horizon, seeds=20)
    gpu_share = np.mean(events.component == 0)
    assert gpu_share == pytest.approx(0.473, abs=0.03)


def test_weibull_shape_one_is_exponential_and_low_shape_front_loads_failures() -> None:
    shape = ClusterShape(gpus=2000)
    horizon = 100 * DAY
    expo = WeibullFailures(shape=1.0, mtbf_hours=5000.0).sample(shape, horizon, seeds=50).counts()
    expected = 2000 * 2400 / 5000
    assert abs(expo.mean() - expected) < 4 * math.sqrt(expected / 50)
    infant = WeibullFailures(shape=0.5, mtbf_hours=5000.0).sample(shape, horizon, seeds=20)
    early = np.mean(infant.time_s < horizon / 2)
    assert early > 0.6  # a falling hazard: most failures in the first half
    worn = WeibullFailures(shape=3.0, mtbf_hours=5000.0, age_hours=4000.0).sample(
        shape, horizon, seeds=20
    )
    fresh = WeibullFailures(shape=3.0, mtbf_hours=5000.0).sample(shape, horizon, seeds=20)
    assert len(worn) > 5 * len(fresh)  # wear-out: old hardware fails far more often


def test_weibull_renewals_approach_the_long_run_rate() -> None:
    # Over many lifetimes a renewal process fails once per mean lifetime.
    shape = ClusterShape(gpus=50)
    model = WeibullFailures(shape=2.0, mtbf_hours=10.0)
    counts = model.sample(shape, 2000 * HOUR, seeds=20).counts()
    assert counts.mean() == pytest.approx(model.expected_events(shape, 2000 * HOUR), rel=0.02)


def test_mixed_failures_superpose() -> None:
    shape = ClusterShape(gpus=256)
    model = MixedFailures(
        (
            ExponentialFailures(mtbf_hours=1000.0),
            ExponentialFailures(mtbf_hours=500.0, component="node"),
        )
    )
    assert model.expected_events(shape, 1000 * HOUR) == pytest.approx(256 + 64)
    events = model.sample(shape, 1000 * HOUR, seeds=30)
    assert set(np.unique(events.component).tolist()) == {0, 1}
    assert "node" in model.describe()


@pytest.mark.parametrize(
    "build",
    [
        lambda: ExponentialFailures(mtbf_hours=-1.0),
        lambda: ExponentialFailures(mtbf_hours=0.0),
        lambda: ExponentialFailures(mtbf_hours=float("nan")),
        lambda: ExponentialFailures(mtbf_hours=10.0, component="switch"),
        lambda: WeibullFailures(shape=-0.5, mtbf_hours=10.0),
        lambda: WeibullFailures(shape=1.0, mtbf_hours=10.0, age_hours=-1.0),
        lambda: MixedFailures(()),
        lambda: llama3_failures(gpus_per_node=0),
    ],
)
def test_bad_model_parameters_raise(build) -> None:
    with pytest.raises(ValueError):
        build()


def test_sampling_rejects_bad_horizon_and_seed_count() -> None:
    model = ExponentialFailures(mtbf_hours=10.0)
    shape = ClusterShape(gpus=8)
    with pytest.raises(ValueError, match="horizon_s"):
        model.sample(shape, -5.0)
    with pytest.raises(ValueError, match="seeds"):
        model.sample(shape, 10.0, seeds=0)


def test_failure_events_validate_their_arrays() -> None:
    shape = ClusterShape(gpus=8)
    good = dict(
        cluster=shape, horizon_s=10.0, num_seeds=1, seed=[0, 0], component=[0, 0], num_gpus=[1, 1]
    )
    FailureEvents(**good, time_s=[1.0, 2.0], first_gpu=[0, 7])
    with pytest.raises(ValueError, match="sorted"):
        FailureEvents(**good, time_s=[2.0, 1.0], first_gpu=[0, 7])
    with pytest.raises(ValueError, match="outside the cluster"):
        FailureEvents(**good, time_s=[1.0, 2.0], first_gpu=[0, 8])
    with pytest.raises(ValueError, match="times"):
        FailureEvents(**good, time_s=[1.0, 10.0], first_gpu=[0, 1])
    events = FailureEvents(**good, time_s=[1.0, 2.0], first_gpu=[0, 7])
    with pytest.raises(ValueError, match="mask"):
        events.select(np.array([1, 0]))
    assert len(events.select(np.array([True, False]))) == 1


def test_trace_round_trips_through_csv(tmp_path: Path) -> None:
    shape = ClusterShape(gpus=64, gpus_per_node=8, nodes_per_rack=2)
    events = MixedFailures(
        (ExponentialFailures(mtbf_hours=5e4), ExponentialFailures(mtbf_hours=3e4, component="rack"))
    ).sample(shape, 2000 * DAY, seeds=2, seed=1)
    path = tmp_path / "trace.csv"
    events.to_csv(path, seed=1)
    replay = TraceReplay.from_csv(path, duration_s=2000 * DAY, random_offset=False)
    again = replay.sample(shape, 2000 * DAY, seeds=3)
    one = slice(events.offsets[1], events.offsets[2])
    for s in range(3):
        mine = slice(again.offsets[s], again.offsets[s + 1])
        assert np.array_equal(again.time_s[mine], events.time_s[one])
        assert np.array_equal(again.first_gpu[mine], events.first_gpu[one])
        assert np.array_equal(again.num_gpus[mine], events.num_gpus[one])


def test_trace_repeats_and_shifts(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "# a comment\ntime_s,component\n10,gpu:1\n\n20,node:0\n30,3\n", encoding="utf-8"
    )
    shape = ClusterShape(gpus=8)
    replay = TraceReplay.from_csv(path, duration_s=40.0, random_offset=False)
    events = replay.sample(shape, 100.0)
    assert events.time_s.tolist() == [10, 20, 30, 50, 60, 70, 90]
    assert replay.expected_events(shape, 100.0) == pytest.approx(7.5)
    shifted = TraceReplay.from_csv(path, duration_s=40.0).sample(shape, 100.0, seeds=5)
    assert np.all(np.isin(shifted.counts(), [7, 8]))
    for s in range(5):
        phases = np.unique(
            np.round(shifted.time_s[shifted.offsets[s] : shifted.offsets[s + 1]] % 40.0, 6)
        )
        circular_gaps = np.diff(np.append(phases, phases[0] + 40.0))
        assert np.allclose(np.sort(circular_gaps), [10.0, 10.0, 20.0])  # the same pattern, shifted


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "header"),
        ("time,component\n1,gpu:0\n", "header"),
        ("time_s,component\nsoon,gpu:0\n", "line 2: time"),
        ("time_s,component\n-1,gpu:0\n", "line 2: time"),
        ("time_s,component\n1,switch:0\n", "line 2: component"),
        ("time_s,component\n1,gpu:x\n", "line 2: component"),
        ("time_s,component\n1,gpu:0,extra\n", "line 2: expected"),
        ("time_s,component\n1,gpu:0\nnan,gpu:1\n", "line 3: time"),
    ],
)
def test_malformed_trace_files_raise_with_line_numbers(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        TraceReplay.from_csv(path)


def test_unreadable_trace_files_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        TraceReplay.from_csv(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="cannot read"):
        TraceReplay.from_csv(tmp_path)  # a directory
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00time")
    with pytest.raises(ValueError, match="cannot read"):
        TraceReplay.from_csv(binary)


def test_trace_naming_hardware_the_cluster_lacks_raises(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time_s,component\n1,node:4\n", encoding="utf-8")
    with pytest.raises(ValueError, match="node 4"):
        TraceReplay.from_csv(path).sample(ClusterShape(gpus=32), 10.0)


@settings(max_examples=40, deadline=None)
@given(
    gpus=st.integers(1, 300),
    gpn=st.integers(1, 16),
    npr=st.integers(1, 4),
    mtbf=st.floats(0.5, 1000.0),
    seeds=st.integers(1, 4),
)
def test_every_model_draws_valid_events(
    gpus: int, gpn: int, npr: int, mtbf: float, seeds: int
) -> None:
    shape = ClusterShape(gpus=gpus, gpus_per_node=gpn, nodes_per_rack=npr)
    model = MixedFailures(
        (
            WeibullFailures(shape=0.7, mtbf_hours=mtbf),
            ExponentialFailures(mtbf_hours=mtbf, component="node"),
            ExponentialFailures(mtbf_hours=mtbf * 3, component="rack"),
        )
    )
    events = model.sample(shape, 50 * HOUR, seeds=seeds)
    assert np.all(events.first_gpu + events.num_gpus <= gpus)
    assert np.all((events.time_s >= 0) & (events.time_s < 50 * HOUR))
    assert events.counts().sum() == len(events)
