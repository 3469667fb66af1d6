"""A package's modules read with ``ast`` (never imported), and the import graph between them.

For benchmarks/code_shape.py. A node is a module by dotted name, package included
(``dl4py.nn.model``); a package's ``__init__.py`` is the package (``dl4py.nn``). An edge is an
``import``/``from`` that names a module of the package: ``from a.b import c`` goes to ``a.b.c``
when that is a module, else to ``a.b``. Imports under ``if TYPE_CHECKING:`` never run and make
no edge. Two graphs are built from the same edges:

- the structural graph (``import_graph``): the edges as written, module-level only or with
  the function-local ones as well. Cycles and upward arrows are counted on it.
- the import-time graph (``import_time_graph``): module-level edges, plus the ``__init__`` of
  every subpackage an import enters from outside (importing ``dl4py.monitor.storage`` from
  ``dl4py.train`` first runs ``dl4py/monitor/__init__.py``). The package's own root is left
  out: it is always initialized first. It answers "would hoisting this import close a cycle?".
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Module:
    name: str                   # "dl4py.nn.model"
    path: str                   # relative to the package folder: "nn/model.py"
    is_package: bool
    tree: ast.Module
    comments: dict[int, str]    # line -> comment text
    comment_only: set[int]      # lines holding nothing but a comment
    line_count: int


def load_package(src: Path) -> dict[str, Module]:
    """Every module under ``src`` by dotted name; a file that does not parse is named and refused."""
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"code_shape: {src} is not a package folder (it has no __init__.py)")
    modules = {}
    for file in sorted(src.rglob("*.py")):
        rel = file.relative_to(src)
        parts = [src.name, *rel.with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        text = file.read_text(encoding="utf-8")
        try:
            tree = ast.parse(text, filename=str(rel))
            comments, comment_only = _comments(text)
        except (SyntaxError, tokenize.TokenError) as exc:
            raise SystemExit(f"code_shape: {rel.as_posix()}: does not parse: {exc}") from None
        modules[name] = Module(name, rel.as_posix(), is_package, tree, comments, comment_only,
                               len(text.splitlines()))
    return modules


def _comments(text: str) -> tuple[dict[int, str], set[int]]:
    comments, comment_only = {}, set()
    lines = text.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            line = token.start[0]
            comments[line] = token.string
            if lines[line - 1].lstrip().startswith("#"):
                comment_only.add(line)
    return comments, comment_only


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: Module) -> list[tuple[ast.Import | ast.ImportFrom, str | None]]:
    """Every import that runs, with the qualified name of its function (None at module level)."""
    found = []

    def visit(body, scope, function):
        for child in body:
            if isinstance(child, ast.If) and _is_type_checking(child):
                visit(child.orelse, scope, function)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, function))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*scope, child.name]
                is_def = not isinstance(child, ast.ClassDef)
                visit(child.body, inner, ".".join(inner) if is_def else function)
            else:
                visit(list(ast.iter_child_nodes(child)), scope, function)

    visit(module.tree.body, [], None)
    return found


def resolve(module: Module, node: ast.Import | ast.ImportFrom, known) -> list[str]:
    """The modules of the package that an import names (rule in the module docstring)."""
    package = module.name.split(".")[0]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known and a.name.split(".")[0] == package]
    if node.level:
        base = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != package:
        return []
    targets = (f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names)
    return [t for t in dict.fromkeys(targets) if t in known]


def import_graph(modules: dict[str, Module], with_local: bool) -> dict[str, set[str]]:
    graph = {name: set() for name in modules}
    for name, module in modules.items():
        for node, function in imports(module):
            if function is None or with_local:
                graph[name].update(resolve(module, node, modules))
    return graph


def entered(importer: str, target: str, modules) -> list[str]:
    """What importing ``target`` from ``importer`` runs: the target and each subpackage ``__init__``
    on its way that the importer is not already inside (the root's is always initialized first)."""
    parts = target.split(".")
    packages = (".".join(parts[:end]) for end in range(2, len(parts)))
    return [target, *(p for p in packages if p in modules and not (importer + ".").startswith(p + "."))]


def import_time_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    graph = import_graph(modules, with_local=False)
    return {importer: {m for t in targets for m in entered(importer, t, modules)}
            for importer, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, and self-loops (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while not component or component[-1] != node:
                    component.append(stack.pop())
                    on_stack.discard(component[-1])
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return sorted(found)


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def floor_of(name: str, floors: dict[str, int]) -> int | None:
    """The floor of the module's top folder or top-level file (``__init__``: the package's root)."""
    parts = name.split(".")
    return floors.get(parts[1] if len(parts) > 1 else "__init__")


def is_upward(importer: str, imported: str, floors: dict[str, int]) -> bool:
    low, high = floor_of(importer, floors), floor_of(imported, floors)
    return low is not None and high is not None and high > low


def upward_arrows(graph: dict[str, set[str]], floors: dict[str, int]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if is_upward(a, b, floors))


def folder_of(module: Module) -> str:
    """The top folder a module's file sits in ("." for a file beside the package's __init__)."""
    return module.path.split("/")[0] if "/" in module.path else "."
