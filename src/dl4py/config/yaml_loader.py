"""Config text as users mean it: ``1e-3`` is a number, and a syntax error names its line.

PyYAML follows YAML 1.1, whose float pattern needs a dot and a signed exponent, so
``1e-3``, ``5e4`` and ``1.0e3`` load as strings. YAML 1.2 (and every user) reads them
as floats; this loader adds that pattern to PyYAML's safe loader and changes nothing else.

PyYAML's own errors span several lines and name ``<unicode string>``; ``load_yaml`` and
``load_json`` raise one ``ConfigSyntaxError`` instead: ``lenet.yaml, line 7, column 3: ...``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from dl4py.errors import ConfigError

__all__ = ["ConfigSyntaxError", "load_json", "load_yaml"]


class _Loader(yaml.SafeLoader):
    """SafeLoader plus YAML 1.2's exponent floats."""


_Loader.add_implicit_resolver(  # copies SafeLoader's table, so yaml.safe_load is untouched
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


class ConfigSyntaxError(ConfigError):
    """Config text that does not parse: ``SOURCE, line L, column C: is not valid YAML: PROBLEM``.
    ``line`` and ``column`` count from 1, as editors do."""

    def __init__(self, source: str, line: int, column: int, problem: str, language: str = "YAML"):
        self.source, self.line, self.column = source, line, column
        self.problem, self.language = problem, language
        super().__init__(f"{source}, line {line}, column {column}", f"is not valid {language}: {problem}")

    def __reduce__(self):  # the default would call __init__ with the message alone
        return type(self), (self.source, self.line, self.column, self.problem, self.language)


def load_yaml(text: str, source: str = "YAML text") -> Any:
    """``yaml.safe_load`` with ``1e-3`` read as 0.001; ``source`` names the text in errors."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = _one_line(exc.problem or exc.context or "syntax error")
        if exc.problem and exc.context:  # "while parsing a flow sequence" says what was left open
            where = exc.context_mark
            opened = f" that starts at line {where.line + 1}, column {where.column + 1}" if where else ""
            problem += f" ({_one_line(exc.context)}{opened})"
        if mark is None:
            raise ConfigError(source, f"is not valid YAML: {problem}") from None
        raise ConfigSyntaxError(source, mark.line + 1, mark.column + 1, problem) from None
    except yaml.reader.ReaderError as exc:  # a character YAML refuses; it has a position only
        line, column = _line_column(text, exc.position)
        character = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        raise ConfigSyntaxError(source, line, column, f"unacceptable character {character}: {exc.reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"is not valid YAML: {_one_line(str(exc))}") from None


def load_json(text: str, source: str = "JSON text") -> Any:
    """``json.loads``; a syntax error is a ``ConfigSyntaxError`` naming ``source`` and the line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigSyntaxError(source, exc.lineno, exc.colno, exc.msg, "JSON") from None


def _line_column(text: str, position: int) -> tuple[int, int]:
    line_start = text.rfind("\n", 0, position) + 1
    return text.count("\n", 0, position) + 1, position - line_start + 1


def _one_line(text: str) -> str:
    return " ".join(text.split())
