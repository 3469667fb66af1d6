"""Overrides and names as users coming from other tools write them: ``--set`` with a dotted path
into a section the config does not have yet, a did-you-mean for a misspelt key, field or choice,
and Lightning's precision names (``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``32-true``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dl4py.backend.precision import resolve_precision
from dl4py.config import DenseLayer, RunConfig
from dl4py.errors import ConfigError

LENET = Path(__file__).resolve().parents[1] / "examples" / "lenet_mnist.yaml"


@pytest.fixture(scope="module")
def run():
    return RunConfig.from_file(LENET)


def test_a_dotted_key_creates_the_optional_section_it_names(run):
    assert run.data.validation is None and run.training.early_stopping is None
    changed = run.with_overrides(["data.validation.split=0.1", "training.early_stopping.patience=2"])
    assert changed.data.validation.split == 0.1
    assert changed.training.early_stopping.patience == 2
    # the same as the mapping form, which worked before
    assert changed.data.validation == run.with_overrides(["data.validation={split: 0.1}"]).data.validation


def test_a_created_section_is_checked_by_its_schema(run):
    with pytest.raises(ConfigError, match=r"data\.validation\.splt: unknown field for ValidationSection "
                                          r"\(did you mean 'split'\?\)"):
        run.with_overrides(["data.validation.splt=0.1"])
    with pytest.raises(ConfigError, match=r"data\.limit_train: must be an integer, got \{'x': 2\}"):
        run.with_overrides(["data.limit_train.x=2"])  # not a section: a value, named


@pytest.mark.parametrize("override, where, suggestion", [
    ("data.validaton.split=0.1", "data.validaton.split", "validation"),
    ("training.precison=half", "training.precison", "precision"),
    ("network.updater.learning_rat=0.1", "network.updater.learning_rat", "learning_rate"),
    ("training.parallelism=dta", "training.parallelism", "data"),
    ("network.weight_init=xavir", "network.weight_init", "xavier"),
])
def test_a_misspelt_key_or_choice_gets_a_did_you_mean(run, override, where, suggestion):
    with pytest.raises(ConfigError, match=rf"^{where.replace('.', r'[.]')}: .*\(did you mean '{suggestion}'\?\)"):
        run.with_overrides([override])


def test_nothing_close_suggests_nothing(run):
    with pytest.raises(ConfigError) as exc:
        run.with_overrides(["training.zzzzzz=1"])
    assert "did you mean" not in str(exc.value) and "valid keys: epochs" in str(exc.value)


def test_a_misspelt_field_in_a_file_gets_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown field for DenseLayer \(did you mean 'n_out'\?\)"):
        DenseLayer.from_dict({"nout": 3}, "network.layers[0]")


@pytest.mark.parametrize("lightning, dl4py_name", [
    ("bf16-mixed", "mixed-bf16"), ("16-mixed", "mixed-fp16"), ("bf16-true", "bfloat16"), ("16-true", "half"),
    ("32-true", "float"), ("64-true", "double"),
])
def test_lightning_precision_names(run, lightning, dl4py_name):
    assert run.with_overrides([f"training.precision={lightning}"]).training.precision == dl4py_name
    assert resolve_precision(lightning).name == dl4py_name


def test_a_keyword_a_config_class_lacks_is_one_config_error():
    """DL4J's builders set nIn (``new ConvolutionLayer.Builder(5, 5).nIn(1)``), as the seed writes
    it: dl4py infers it, and says so instead of a bare TypeError; other unknown keywords get a
    did-you-mean and the valid fields."""
    from dl4py.config import ConvolutionLayer

    with pytest.raises(ConfigError, match=r"^ConvolutionLayer\.n_in: dl4py infers it from the input type"):
        ConvolutionLayer(n_in=1, n_out=20, kernel_size=5)
    with pytest.raises(ConfigError, match=r"^DenseLayer\.activaton: unknown field \(did you mean 'activation'\?\); "
                                          r"valid fields: activation, "):
        DenseLayer(n_out=3, activaton="relu")
    with pytest.raises(TypeError, match="missing 1 required"):  # a missing field stays Python's own error
        DenseLayer()
