"""Every `FailureSource` keeps the same contract; the two Poisson sources agree."""

from __future__ import annotations

import math

import pytest

from simulations.failure_sources import (
    FailureProcess,
    FailureSource,
    ModelFailures,
    ScheduledFailures,
)
from simulations.traces import ExponentialFailures, MixedFailures, WeibullFailures

STAGES, STEP_S, ATTEMPTS = 4, 600.0, 400
HORIZON_S = STEP_S * ATTEMPTS


def sources() -> dict[str, FailureSource]:
    return {
        "process": FailureProcess(hourly_rate=0.1, seed=3),
        "scheduled": ScheduledFailures(kills={2: (1,), 5: (0, 3)}),
        "exponential": ModelFailures(
            model=ExponentialFailures(mtbf_hours=8.0), stages=STAGES, horizon_s=HORIZON_S, seed=3
        ),
        "weibull": ModelFailures(
            model=WeibullFailures(mtbf_hours=8.0, shape=0.7),
            stages=STAGES,
            horizon_s=HORIZON_S,
            seed=3,
        ),
        "nodes and gpus": ModelFailures(
            model=MixedFailures(
                parts=(
                    ExponentialFailures(mtbf_hours=10.0),
                    ExponentialFailures(mtbf_hours=40.0, component="node"),
                )
            ),
            stages=STAGES,
            horizon_s=HORIZON_S,
            gpus_per_node=2,
        ),
    }


@pytest.mark.parametrize("name", list(sources()))
def test_every_source_keeps_the_contract(name: str) -> None:
    source, again = sources()[name], sources()[name]
    assert isinstance(source, FailureSource)
    assert 0.0 <= source.hourly_rate < 1.0 and isinstance(source.seed, int)
    assert 0.0 <= source.probability(STEP_S) <= 1.0
    draws = [source.failed(a, STAGES, STEP_S) for a in range(ATTEMPTS)]
    assert draws == [again.failed(a, STAGES, STEP_S) for a in range(ATTEMPTS)]  # deterministic
    for stages in draws:
        assert stages == sorted(set(stages)) and all(0 <= s < STAGES for s in stages)
    assert any(draws), "a source that never fails tests nothing"


def test_the_rate_process_and_the_exponential_model_fail_as_often() -> None:
    """Both are Poisson at the same per-stage rate: the same failure frequency (fixed
    seeds, so the comparison is deterministic; 1,600 stage-attempts each)."""
    rate = 0.1
    process = FailureProcess(hourly_rate=rate, seed=1)
    mtbf = -1.0 / math.log1p(-rate)  # P(no failure in an hour) = exp(-1 / mtbf) = 1 - rate
    model = ModelFailures(
        model=ExponentialFailures(mtbf_hours=mtbf), stages=STAGES, horizon_s=HORIZON_S, seed=1
    )
    assert model.hourly_rate == pytest.approx(rate)
    assert model.probability(STEP_S) == pytest.approx(process.probability(STEP_S))

    def frequency(source: FailureSource) -> float:
        hits = sum(len(source.failed(a, STAGES, STEP_S)) for a in range(ATTEMPTS))
        return hits / (ATTEMPTS * STAGES)

    expected = process.probability(STEP_S)
    assert frequency(process) == pytest.approx(expected, rel=0.35)
    assert frequency(model) == pytest.approx(expected, rel=0.35)


def test_a_model_source_refuses_what_it_did_not_sample() -> None:
    source = sources()["exponential"]
    with pytest.raises(ValueError, match="sampled 4 stages"):
        source.failed(0, 3, STEP_S)
    with pytest.raises(ValueError, match="past the sampled horizon"):
        source.failed(ATTEMPTS, STAGES, STEP_S)


def test_a_node_failure_takes_the_stages_on_that_node_together() -> None:
    source = ModelFailures(
        model=ExponentialFailures(mtbf_hours=1.0, component="node"),
        stages=STAGES,
        horizon_s=HORIZON_S,
        gpus_per_node=2,
    )
    draws = [set(source.failed(a, STAGES, STEP_S)) for a in range(ATTEMPTS)]
    assert any(draws)
    for stages in draws:  # nodes hold stages {0, 1} and {2, 3}
        assert not stages or stages in ({0, 1}, {2, 3}, {0, 1, 2, 3})
