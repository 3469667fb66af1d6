"""``dl4py schema``: the run config as a JSON Schema for editors. Every example config validates
against it; a misspelt key, a choice not in the list and a layer field that does not exist are
each flagged at their path; the schema is itself valid (draft 2020-12); the command prints it or
writes it atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dl4py.cli import main
from dl4py.config import RunConfig
from dl4py.config.json_schema import run_config_schema

jsonschema = pytest.importorskip("jsonschema")

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def validator():
    schema = run_config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_validates(validator, path):
    data = yaml.safe_load(path.read_text())
    assert sorted(e.message for e in validator.iter_errors(data)) == []
    # and what dl4py writes back of it (every field, defaults included) too
    assert sorted(e.message for e in validator.iter_errors(RunConfig.from_file(path).to_dict())) == []


@pytest.mark.parametrize("change, path", [
    (lambda d: d["training"].update(epoch=2), ["training"]),
    (lambda d: d["training"].update(precision="mixed-bf8"), ["training", "precision"]),
    (lambda d: d["network"]["layers"][0].update(n_outt=4), ["network", "layers", 0]),
    (lambda d: d["network"]["layers"][0].update(type="convolutionn"), ["network", "layers", 0]),
    (lambda d: d["network"]["updater"].update(learning_rate="fast"), ["network", "updater"]),
])
def test_mistakes_are_flagged_where_they_are(validator, change, path):
    data = yaml.safe_load(EXAMPLES[0].read_text())
    change(data)
    errors = list(_flat(validator.iter_errors(data)))
    assert errors, "the schema let the mistake through"
    assert any(list(error.absolute_path)[:len(path)] == path for error in errors), [e.absolute_path for e in errors]


def _flat(errors):
    """Each error and, inside a ``oneOf``/``anyOf`` (a network is a list of layers or a graph), the
    errors of each alternative: where an editor points."""
    for error in errors:
        yield error
        yield from _flat(error.context or ())


def test_the_command_prints_it_or_writes_it(tmp_path, capsys):
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == run_config_schema()
    target = tmp_path / "dl4py.schema.json"
    assert main(["schema", "--output", str(target)]) == 0
    assert json.loads(target.read_text()) == printed
    assert "yaml-language-server: $schema=" in capsys.readouterr().err
