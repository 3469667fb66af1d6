"""``dl4py import-dl4j``: a DL4J model zip becomes a dl4py model file that predicts as the
import does; a file it cannot import is one line and status 2, with nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import dl4py
from dl4py.cli import main

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "dl4j-models"
MOON = MODELS / "dl4j-integration-tests" / "MLPMoon" / "Model_RANDOM_INIT_UNTRAINED.zip"
NO_INPUT_TYPE = MODELS / "regression_testing" / "080" / "080_ModelSerializer_Regression_CNN_1.zip"

pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason=f"needs DL4J's files in {MODELS}")


def test_the_model_file_written_predicts_as_the_import(tmp_path, capsys):
    zip_copy = tmp_path / "moon.zip"
    shutil.copy(MOON, zip_copy)
    assert main(["import-dl4j", str(zip_copy), "--summary"]) == 0
    out = capsys.readouterr().out
    written = tmp_path / "moon.dl4py"  # beside the zip by default
    assert out.rstrip().endswith(str(written)) and "Total parameters: 102" in out
    features = torch.from_numpy(np.random.default_rng(0).normal(size=(16, 2)).astype(np.float32))
    expected = dl4py.import_dl4j(MOON).output(features)
    assert torch.equal(dl4py.load(written).output(features), expected)


@pytest.mark.parametrize("args, message", [
    ([str(NO_INPUT_TYPE)], "layer 0 (org.deeplearning4j.nn.conf.layers.ConvolutionLayer): the file does not hold "
                           "the input's shape"),
    ([str(MODELS / "regression_testing" / "080" / "080_ModelSerializer_Regression_MLP_2.zip"), "--strict"],
     "strict import, but it would leave out"),
])
def test_what_cannot_be_imported_is_one_line_and_nothing_is_written(tmp_path, capsys, args, message):
    output = tmp_path / "out.dl4py"
    assert main(["import-dl4j", *args, "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dl4py import-dl4j: error: ") and message in err[-1], err
    assert "Traceback" not in "\n".join(err) and not output.exists()


def test_a_dl4py_file_given_for_a_dl4j_one_is_named(tmp_path, capsys):
    ours = tmp_path / "ours.dl4py"
    dl4py.import_dl4j(MOON).save(ours)
    assert main(["import-dl4j", str(ours), "--output", str(tmp_path / "again.dl4py")]) == 2
    assert "has no configuration.json entry" in capsys.readouterr().err
    assert main(["import-dl4j", str(ours), "--output", str(ours)]) == 2  # never over the input
    assert "is the DL4J file itself" in capsys.readouterr().err


def test_dl4py_export_format_dl4j_writes_a_zip_that_imports_as_the_same_network(tmp_path, capsys):
    """The way back: a dl4py model file, exported as DL4J's zip, imports with the same
    parameters and outputs (docs/dl4j-import.md; tests/test_dl4j_write.py tests the writer)."""
    ours = tmp_path / "moon.dl4py"
    model = dl4py.import_dl4j(MOON)
    model.save(ours)
    assert main(["export", str(ours), "--format", "dl4j"]) == 0
    written = tmp_path / "moon.zip"  # beside the model by default
    assert capsys.readouterr().out.strip() == str(written)
    again = dl4py.import_dl4j(written)
    features = torch.from_numpy(np.random.default_rng(1).normal(size=(8, 2)).astype(np.float32))
    assert torch.equal(again.output(features), model.output(features))
    for (name, a), b in zip(model.module.state_dict().items(), again.module.state_dict().values()):
        assert torch.equal(a, b), name
