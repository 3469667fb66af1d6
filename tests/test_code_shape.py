"""benchmarks/code_shape.py on a tiny package written here: each count it reports, checked item by item.

The package is named dl4py so that the script's own floors, optional packages and file rules
apply; nothing of it is imported, only read.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import code_shape  # noqa: E402


def _lines(name: str, count: int, first: str = "") -> str:
    """A function ``count`` lines long from its def line to its last."""
    body = [f"    {first}"] if first else []
    body += [f"    x{i} = {i}" for i in range(count - 1 - len(body))]
    return "\n".join([f"def {name}():", *body]) + "\n"


FILES = {
    # the root re-exports the model; nn.model imports the root back inside a function (upward,
    # and a cycle only through the root, which is not counted as one)
    "__init__.py": "from dl4py.nn.model import Model\n__version__ = '1'\n",
    "errors.py": "class Err(Exception):\n    pass\n",
    "odd.py": "X = 1\n",  # on no floor
    "cli.py": (_lines("_parser", 70, "p.add_argument('--x')") + _lines("_memory", 70)
               + "def main():\n    import json\n"),
    "config/__init__.py": "",
    "config/a.py": "from dl4py.config.b import B\nA = 1\n",   # a module-level cycle inside one folder
    "config/b.py": "from . import a\nB = 1\n",               # a relative import names the module too
    "config/schema.py": _lines("coerce", 80),
    "data/__init__.py": "",
    "data/source.py": textwrap.dedent("""\
        from dl4py.nn.model import Model  # upward: data sits below nn

        def read():
            from dl4py.errors import Err  # cycle: claimed, but errors imports nothing
        """),
    "nn/__init__.py": "",
    "nn/model.py": textwrap.dedent("""\
        from typing import TYPE_CHECKING

        from dl4py.train.loop import fit

        if TYPE_CHECKING:
            from dl4py.serve.app import make_app

        class Model:
            def version(self, other):
                from dl4py import __version__
                other.epoch_count = 0  # the owner may write its state
                if TYPE_CHECKING:
                    from dl4py.serve.app import make_app
                return __version__
        """),
    "train/__init__.py": "",
    "train/loop.py": textwrap.dedent("""\
        def fit(model, replica, name, a):
            from dl4py.nn.model import Model  # cycle: dl4py.nn.model imports this module
            import json
            from dl4py.errors import Err
            import pandas
            # optional: pyarrow (extra data)
            import pyarrow
            import csv
            model.epoch_count += 1
            replica.optimizer = None
            a, model.iteration_count = 1, 2
            setattr(model, "batch_in_epoch", 0)
            setattr(model, name, 0)
            model.other = 1
            getattr(model, "config", None)

        class Loop:
            def __init__(self, model):
                self.batch_in_epoch = 0
                self.model.scaler = None

            def seven(self, a, b, c, d, e, f, g):
                pass

            def eight(self, a, b, c, d, e, f, g, h):
                pass

        def eight_kw(a, b, c, d, e, f, *, g, **kw):
            pass

        def two(*args, **kwargs):
            pass
        """) + _lines("long_one", 61) + _lines("just_sixty", 60),
    # hoisting train/listen.py's import would close a cycle only through monitor/__init__.py
    "monitor/__init__.py": "from dl4py.monitor.stats import S\n",
    "monitor/stats.py": "from dl4py.train.listen import L\nS = 1\n",
    "monitor/storage.py": "F = 1\n",
    "train/listen.py": "L = 1\n\ndef files():\n    from dl4py.monitor.storage import F\n",
    "serve/__init__.py": "",
    "serve/app.py": textwrap.dedent("""\
        def make_app(model, error):
            model.update_count: int = 3
            getattr(model, "config", None)
            hasattr(self._model, "output")
            getattr(error, "headers", None)
        """),
}


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src") / "dl4py"
    for name, text in FILES.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return src


@pytest.fixture(scope="module")
def shape(package) -> dict:
    return code_shape.measure(package)


def test_long_functions_count_from_def_to_last_line_and_set_the_parser_and_schema_apart(shape):
    assert [(i["function"], i["lines"]) for i in shape["long_functions"]] == [("_memory", 70), ("long_one", 61)]
    assert [i["where"] for i in shape["long_functions_allowed"]] == ["cli.py:1", "config/schema.py:1"]


def test_parameters_count_all_but_self_with_keyword_only_and_star_arguments(shape):
    assert {i["function"]: i["parameters"] for i in shape["many_parameters"]} == {"Loop.eight": 8, "eight_kw": 8}


def test_function_local_imports_are_classified_by_their_comment_or_package(shape):
    assert [(i["where"], i["kind"]) for i in shape["local_imports"]] == [
        ("data/source.py:4", "cycle"),
        ("nn/model.py:10", "habit"),                  # the root's __version__
        ("train/listen.py:4", "habit"),               # closes a cycle through monitor/__init__.py
        ("train/loop.py:2", "cycle"),
        ("train/loop.py:3", "habit"),                 # json
        ("train/loop.py:4", "habit"),                 # dl4py.errors
        ("train/loop.py:5", "optional dependency"),   # pandas
        ("train/loop.py:7", "optional"),              # the comment line above it
        ("train/loop.py:8", "optional"),              # grouped under that comment
    ]  # cli.py's and the TYPE_CHECKING ones are not counted
    assert shape["local_import_kinds"] == {"cycle": 2, "optional": 2, "lazy": 0, "optional dependency": 1, "habit": 4}
    assert shape["habit_own_modules"] == 3            # errors, the root's __version__, monitor.storage
    assert shape["habit_closing_cycle"] == 2          # __version__ (the root imports nn.model), storage
    assert shape["habit_on_cycle"] == 0               # one runs through the root, one through an __init__
    assert shape["habit_upward"] == 2
    assert shape["cycle_comments_closing_no_cycle"] == 1  # data/source.py's claim
    claimed = next(i for i in shape["local_imports"] if i["where"] == "train/loop.py:2")
    assert claimed["closes_cycle"] and claimed["on_cycle"] and claimed["upward"]


def test_cycles_and_upward_arrows_module_level_and_with_local_imports(shape):
    top, full = shape["graph_module_level"], shape["graph_with_local"]
    assert top["cycles"] == [["config.a", "config.b"]] and top["cycles_across_folders"] == 0
    assert full["cycles"] == [["config.a", "config.b"], ["nn.model", "train.loop"]]
    assert full["cycles_across_folders"] == 1
    assert top["upward"] == ["data.source -> nn.model"]
    assert full["upward"] == ["data.source -> nn.model", "nn.model -> dl4py", "train.listen -> monitor.storage",
                              "train.loop -> nn.model"]
    assert full["upward_folder_pairs"] == ["data -> nn", "nn -> .", "train -> monitor", "train -> nn"]
    assert shape["unplaced_modules"] == ["odd"]


def test_state_writes_from_other_modules_and_probes_on_the_model(shape):
    assert [i["write"] for i in shape["state_writes"]] == [
        "model.update_count", "model.epoch_count", "replica.optimizer", "model.iteration_count",
        "model.batch_in_epoch", "self.model.scaler"]
    assert shape["state_writes_to_counters"] == 4 and shape["state_writing_modules"] == 2
    assert [i["probe"] for i in shape["probes"]] == ["getattr(model, 'config', None)",
                                                      "hasattr(self._model, 'output')"]
    assert shape["getattr_hasattr_calls"] == 3


def test_the_command_writes_json_with_paths_relative_to_the_package(package, tmp_path, capsys):
    out = tmp_path / "shape.json"
    assert code_shape.main([str(package), "--json", str(out), "--list"]) == 0
    text = out.read_text()
    assert str(package.parent) not in text
    result = json.loads(text)
    assert "commit" in result and len(result["long_functions"]) == 2
    assert result["counts"]["functions over 60 lines"] == 2
    assert result["counts"]["import cycles, local imports too"] == 2
    table = capsys.readouterr().out
    assert "functions over 60 lines" in table and "train/loop.py:2 [cycle, closes cycle, on cycle, upward]" in table


def test_bad_input_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(SystemExit, match="has no __init__.py"):
        code_shape.measure(tmp_path)
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "broken.py").write_text("def f(:\n")
    with pytest.raises(SystemExit, match="broken.py: does not parse"):
        code_shape.measure(tmp_path)


def test_a_lazy_comment_is_its_own_kind_and_a_reasonless_import_a_habit():
    assert code_shape.classify("# lazy: only distributed plans load it", False) == "lazy"
    assert code_shape.classify("# optional: pyspark (extra spark)", True) == "optional"
    assert code_shape.classify("", True) == "optional dependency"
    assert code_shape.classify("# not lazy, a habit", False) == "habit"
