"""Imports stay at the top of a module, so its header says what it depends on (issue 30).

An import inside a function is allowed only with the reason on its line, as a comment:
``# cycle: <module> imports this module`` (hoisting it would close an import cycle),
``# optional: <package> (extra <name>)`` (a dependency dl4py does not require), or
``# lazy: ...`` (kept off the import path of ``dl4py --help``; rare). Read with ``ast`` and
``tokenize`` only: nothing is imported, so the check costs well under a second.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dl4py"
# The CLI loads each command's modules only when that command runs: its imports are its dispatch.
EXEMPT = {"cli.py"}
REASON = re.compile(r"(?:^|\s)#\s*(cycle|optional|lazy):\s*(\S.*)")
MODULE = re.compile(r"\bdl4py(?:\.\w+)+")
INDENTED_IMPORT = re.compile(r"^[ \t]+(?:import|from)\s", re.MULTILINE)

def _comments(source: str) -> dict[int, str]:
    """The comment on each line, by line number."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0]: tok.string for tok in tokens if tok.type == tokenize.COMMENT}


def _exists(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def local_imports(path: Path) -> list[tuple[int, str]]:
    """(line, kind) for each import inside a function of ``path``: kind is the reason its
    comment gives (cycle, optional, lazy), or "habit" when none is given or a cycle's reason
    names no dl4py module that exists."""
    source = path.read_text(encoding="utf-8")
    if not INDENTED_IMPORT.search(source):
        return []  # no import below the top level: nothing to parse
    functions = [node for node in ast.walk(ast.parse(source, str(path)))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    # keyed by position: a nested function's imports are walked once per enclosing function
    imports = {(node.lineno, node.col_offset): node for function in functions for node in ast.walk(function)
               if isinstance(node, (ast.Import, ast.ImportFrom))}
    comments = _comments(source) if imports else {}
    return sorted((node.lineno, _reason(node, comments)) for node in imports.values())


def _reason(node: ast.stmt, comments: dict[int, str]) -> str:
    for line in range(node.lineno, node.end_lineno + 1):
        match = REASON.search(comments.get(line, ""))
        if match:
            kind, text = match.groups()
            if kind == "cycle" and not any(_exists(name) for name in MODULE.findall(text)):
                return "habit"  # a cycle with no module named, or one that no longer exists
            return kind
    return "habit"


@cache
def _scan() -> dict[str, list[tuple[int, str]]]:
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name not in EXEMPT:
            files[name] = local_imports(path)
    return files


def test_every_import_inside_a_function_says_why():
    files = _scan()
    counts = Counter(kind for imports in files.values() for _, kind in imports)
    print("imports inside functions, outside cli.py:", dict(sorted(counts.items())))  # information only
    unexplained = [f"src/dl4py/{name}:{line}" for name, imports in files.items()
                   for line, kind in imports if kind == "habit"]
    if unexplained:
        pytest.fail("imports inside a function with no reason: hoist each to the top of its module, or say why on "
                    "its line with '# cycle: dl4py.<module> imports this module' or '# optional: <package> "
                    "(extra <name>)':\n  " + "\n  ".join(unexplained), pytrace=False)
