"""One cost vocabulary: the three simulators' models share their fields, checks and loader."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest

from simulations.costs import (
    RENAMED,
    CostModel,
    Costs,
    EmbeddingTimeModel,
    RecoveryCosts,
    TimeModel,
)

ROOT = Path(__file__).resolve().parents[1]
MODELS: list[type[Costs]] = [CostModel, TimeModel, EmbeddingTimeModel]


def _names(model: type[Costs]) -> set[str]:
    return {f.name for f in dataclasses.fields(model)}


def test_every_model_has_the_shared_fields_under_one_name() -> None:
    shared = _names(Costs)
    assert shared == {"step_s", "checkpoint_write_s", "checkpoint_load_s"}
    for model in MODELS:
        assert issubclass(model, Costs) and shared <= _names(model)
    recovery = _names(RecoveryCosts) - shared
    assert recovery == {"detect_s", "replace_s", "transfer_bytes_per_s"}
    assert issubclass(CostModel, RecoveryCosts) and issubclass(EmbeddingTimeModel, RecoveryCosts)
    # The convention of the module docstring: seconds end in _s, rates in _bytes_per_s.
    for model in MODELS:
        for name in _names(model) - model._SETTINGS:
            assert name.endswith(("_s", "_bytes", "_steps", "_factor", "_scale")), name
        assert not _names(model) & set(RENAMED), model


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("field", ["step_s", "checkpoint_write_s", "checkpoint_load_s"])
def test_a_shared_field_is_checked_the_same_in_every_model(model: type[Costs], field: str) -> None:
    for bad in (-1.0, math.nan, math.inf, "1", True):
        with pytest.raises(ValueError, match=rf"{model.__name__}\.{field} must be"):
            model(**{field: bad})


@pytest.mark.parametrize("model", [CostModel, EmbeddingTimeModel], ids=lambda m: m.__name__)
def test_transfer_is_bytes_per_second_and_may_be_free(model: type[RecoveryCosts]) -> None:
    assert model(transfer_bytes_per_s=2e9).transfer_s(1e9) == 0.5
    assert model(transfer_bytes_per_s=math.inf).transfer_s(1e9) == 0.0
    with pytest.raises(ValueError, match="transfer_bytes_per_s must be > 0"):
        model(transfer_bytes_per_s=0.0)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_from_dict_reads_back_to_dict_and_refuses_old_and_unknown_names(
    model: type[Costs],
) -> None:
    costs = model(step_s=3.0, checkpoint_write_s=4.0)
    assert model.from_dict(costs.to_dict()) == costs
    assert model.from_dict({"step_s": 3.0, "_source": "bench"}) == model(step_s=3.0)
    for old, new in model.renamed.items():
        with pytest.raises(ValueError, match=rf"in \[x\]: '{old}' is now '{new}'"):
            model.from_dict({old: 1.0}, "[x]")
    with pytest.raises(ValueError, match=rf"unknown {model.__name__} field\(s\) \['stp_s'\]"):
        model.from_dict({"stp_s": 1.0})
    with pytest.raises(ValueError, match="JSON object"):
        model.from_dict([1.0])  # type: ignore[arg-type]


def test_the_embedding_models_own_rename_and_setting() -> None:
    assert EmbeddingTimeModel.renamed["interval"] == "checkpoint_formula"
    assert "interval" not in TimeModel.renamed
    assert EmbeddingTimeModel(checkpoint_formula="young").checkpoint_formula == "young"
    with pytest.raises(ValueError, match="checkpoint_formula must be 'daly' or 'young'"):
        EmbeddingTimeModel(checkpoint_formula="yung")


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"_script_{name}", ROOT / "scripts" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("old", "new"),
    [("--bandwidth", "--transfer-bytes-per-s"), ("--interval", "--checkpoint-formula")],
)
def test_the_embedding_cli_refuses_a_renamed_flag(
    old: str, new: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _script("embedding_experiment").main([old, "1", "--report-only"])
    assert exit_info.value.code == 2
    assert f"{old} is now {new}" in capsys.readouterr().err
