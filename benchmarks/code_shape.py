"""The shape of dl4py's code, measured statically: the counts issue 30 asks to see before and after.

    python3 benchmarks/code_shape.py [SRC_DIR] [--json OUT] [--list]

SRC_DIR is the package folder (default: src/dl4py beside this script). Only Python's ``ast``
and ``tokenize`` read it: nothing of dl4py is imported, so any checkout can be measured, and
the same script measures the code before the redesign and after it. What each count means:

- long function: more than 60 lines from its ``def`` line to its last line (decorators not
  counted; methods and nested functions are functions). Those in cli.py that build the argument
  parser (they call ``add_argument``/``add_parser``/...) and those in config/schema.py (the
  schema tables) are listed apart, as allowed.
- many parameters: more than 7, counting every parameter but a leading ``self``/``cls``,
  keyword-only ones included, ``*args`` and ``**kwargs`` one each. Lambdas are not counted.
- function-local import: an ``import``/``from ... import`` anywhere inside a ``def`` (any depth),
  outside cli.py; one under ``if TYPE_CHECKING:`` never runs and is not one. Its kind: "cycle" or
  "optional" when a comment containing that word sits on the import's lines ("lazy" for a
  ``lazy:`` comment: torch modules only some plans load), or on the comment
  line just above it (or above the uncommented imports it is grouped with); else "optional
  dependency" when it imports one of OPTIONAL_PACKAGES; else "habit". For habits the script also
  says how many name the package's own modules, how many would close an import-time cycle if
  hoisted alone, how many sit on a cycle of the graph with function-local imports, and how many
  point up a floor. A "cycle" comment on an import whose hoisting would close no cycle is counted.
- import graph (benchmarks/_import_graph.py says how imports become edges): cycles are strongly
  connected components of more than one module, or self-loops, found without the package's root
  ``__init__`` (it re-exports the whole API, so every import of the root from inside would weld
  unrelated cycles into one; those imports are upward arrows, counted below). A cycle crosses
  folders when its modules sit in more than one top folder. An arrow (importer, imported) is
  upward when the imported module's floor is higher (FLOORS below says where each floor comes
  from; a module on no floor is reported, never guessed); each pair counts once, and the
  distinct pairs of top folders are given too. Both are reported for module-level imports and
  with the function-local ones as well.
- state writes: assignments (``=``, ``+=``, annotated, tuple targets, ``setattr`` with a literal
  name) to one of STATE_FIELDS on anything but ``self``, outside nn/model.py.
- probes: ``getattr``/``hasattr`` calls in PROBED_FOLDERS whose first argument is the model (a
  name or attribute in MODEL_NAMES, leading underscores ignored); every ``getattr``/``hasattr``
  call there is counted as well.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from _import_graph import (Module, cycles, entered, floor_of, folder_of, import_graph, import_time_graph, imports,
                           is_upward, load_package, reaches, resolve, upward_arrows)

LONG_FUNCTION = 60
MANY_PARAMETERS = 7

# The floors, lowest first: a module may import from its own floor or below. A key is a top folder
# of the package or a file beside its __init__.py ("__init__": the package's own __init__.py).
# Source: DESIGN.md's layout and one-way flow (config -> network -> trainer -> listeners -> run
# directory; launchers only start ranks; the planner reads the memory estimator) and issue 30's
# order, settled against the module-level imports of the code before the redesign (commit 0b0d295),
# none of which points up under this table. Where the two disagreed the code decided: eval imports
# only errors and is used by nn and train, so it sits beside data; the model (nn) calls the loop
# (train) while train reaches nn only from inside functions (as Keras' Model inherits its Trainer),
# so train sits below nn; memory reads parallel's plan constants and nothing in parallel reads
# memory, so memory sits above parallel; sweep uses run_dir; resume and launchers serve the runner;
# the root __init__ re-exports the API and the CLI uses it. Each move issue 30 names (options into
# config, predict into nn, the savers into nn, from_config beside the runner, the device-memory
# query into backend, __version__ on its own) removes an arrow this table calls upward.
FLOORS = {
    "errors": 0, "io": 0, "folders": 0, "process_guard": 0, "version": 0,
    "backend": 1,
    "config": 2,
    "data": 3, "eval": 3,
    "train": 4,
    "nn": 5,
    "parallel": 6,
    "memory": 7,
    "inference": 8, "export": 8, "monitor": 8, "dl4j": 8, "serve": 8, "spark": 8, "sweep": 8, "doctor": 8, "plan": 8,
    "bench": 8, "run_dir": 8,
    "runner": 9, "resume": 9, "launchers": 9, "run_data": 9,
    "__init__": 10,
    "cli": 11, "__main__": 11,
}

# Import names of the optional dependencies: pyproject.toml's [project.optional-dependencies]
# (data, hf, spark, tensorboard, mlflow, progress, export, serve), plus h11 (uvicorn's own) and
# psutil and playwright (only in the test extra: dl4py must run without them). A dotted entry
# matches that module and those below it (torch.utils.tensorboard needs tensorboard).
OPTIONAL_PACKAGES = (
    "pandas", "pyarrow", "PIL", "datasets", "pyspark", "tensorboard", "torch.utils.tensorboard",
    "mlflow", "tqdm", "onnx", "onnxscript", "onnxruntime", "starlette", "uvicorn", "h11",
    "psutil", "playwright",
)
STATE_FIELDS = frozenset({
    "iteration_count", "epoch_count", "batch_in_epoch", "update_count", "_last_score",
    "_update_count", "master", "scaler", "module", "optimizer", "parallel_layout", "_train_step",
})
COUNTERS = frozenset({"iteration_count", "epoch_count", "batch_in_epoch", "update_count", "_last_score",
                      "_update_count"})
STATE_OWNER = "nn/model.py"
MODEL_NAMES = frozenset({"model", "replica", "net", "network"})
PROBED_FOLDERS = ("serve", "export", "inference", "monitor")
LOCAL_IMPORTS_ALLOWED_IN = "cli.py"
PARSER_CALLS = frozenset({"add_argument", "add_parser", "add_subparsers", "add_argument_group"})
SCHEMA_TABLES = "config/schema.py"


@dataclass
class Shape:
    long_functions: list = field(default_factory=list)
    long_allowed: list = field(default_factory=list)
    many_parameters: list = field(default_factory=list)
    local_imports: list = field(default_factory=list)
    state_writes: list = field(default_factory=list)
    probes: list = field(default_factory=list)
    getattr_calls: int = 0


def functions(module: Module) -> list[tuple[str, ast.FunctionDef]]:
    """(qualified name, node) for every def in the module, methods and nested functions included."""
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    found.append((".".join([*scope, child.name]), child))
                visit(child, [*scope, child.name])
            else:
                visit(child, scope)

    visit(module.tree, [])
    return found


def parameter_count(node: ast.FunctionDef) -> int:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    if positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)


def _builds_parser(node: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in PARSER_CALLS
               for n in ast.walk(node))


def reason(module: Module, node: ast.AST, import_lines: set[int]) -> str:
    """The comment that gives an import its reason: on its lines, else just above its group."""
    own = " ".join(module.comments.get(line, "") for line in range(node.lineno, node.end_lineno + 1))
    if own.strip():
        return own
    line = node.lineno - 1
    while line in import_lines and line not in module.comments:
        line -= 1
    return module.comments.get(line, "") if line in module.comment_only else ""


def _is_optional(node) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(n == p or n.startswith(p + ".") for n in names for p in OPTIONAL_PACKAGES)


def classify(comment: str, optional_dependency: bool) -> str:
    text = comment.lower()
    if "cycle" in text:
        return "cycle"
    if "optional" in text:
        return "optional"
    if "lazy:" in text:
        return "lazy"
    return "optional dependency" if optional_dependency else "habit"


def _target_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _state_targets(node: ast.AST):
    """(object, field) pairs an assignment statement or setattr call writes."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
          and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
        return [(node.args[0], node.args[1].value)]
    else:
        return []
    pairs = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute):
            pairs.append((target.value, target.attr))
    return pairs


def _is_model(node: ast.AST) -> bool:
    name = _target_name(node)
    return name is not None and name.lstrip("_") in MODEL_NAMES


def _where(module: Module, node: ast.AST) -> str:
    return f"{module.path}:{node.lineno}"


def _scan_functions(module: Module, shape: Shape) -> None:
    for qualname, node in functions(module):
        length = node.end_lineno - node.lineno + 1
        if length > LONG_FUNCTION:
            allowed = module.path == SCHEMA_TABLES or (module.path == "cli.py" and _builds_parser(node))
            item = {"where": _where(module, node), "function": qualname, "lines": length}
            (shape.long_allowed if allowed else shape.long_functions).append(item)
        count = parameter_count(node)
        if count > MANY_PARAMETERS:
            shape.many_parameters.append({"where": _where(module, node), "function": qualname, "parameters": count})


def _scan_imports(module: Module, modules: dict[str, Module], shape: Shape) -> None:
    found = imports(module)
    import_lines = {line for node, _ in found for line in range(node.lineno, node.end_lineno + 1)}
    for node, function in found:
        if function is None or module.path == LOCAL_IMPORTS_ALLOWED_IN:
            continue
        comment = reason(module, node, import_lines)
        shape.local_imports.append({
            "where": _where(module, node), "function": function, "import": ast.unparse(node),
            "kind": classify(comment, _is_optional(node)), "comment": comment.strip(),
            "importer": module.name, "targets": resolve(module, node, modules)})


def _scan_state(module: Module, shape: Shape) -> None:
    probed = module.path.split("/")[0] in PROBED_FOLDERS
    for node in ast.walk(module.tree):
        if module.path != STATE_OWNER:
            for obj, attr in _state_targets(node):
                if attr in STATE_FIELDS and not (isinstance(obj, ast.Name) and obj.id == "self"):
                    shape.state_writes.append({"where": _where(module, node), "write": f"{ast.unparse(obj)}.{attr}",
                                               "counter": attr in COUNTERS})
        if (probed and isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args):
            shape.getattr_calls += 1
            if _is_model(node.args[0]):
                shape.probes.append({"where": _where(module, node), "probe": ast.unparse(node)})


def scan(modules: dict[str, Module]) -> Shape:
    """Everything measured file by file: functions, function-local imports, state writes, probes."""
    shape = Shape()
    for module in modules.values():
        _scan_functions(module, shape)
        _scan_imports(module, modules, shape)
        _scan_state(module, shape)
    for items in vars(shape).values():
        if isinstance(items, list):
            items.sort(key=lambda item: (item["where"].split(":")[0], int(item["where"].split(":")[1])))
    return shape


def _short(name: str) -> str:
    return name.split(".", 1)[1] if "." in name else name


def _rootless(graph: dict[str, set[str]], root: str) -> dict[str, set[str]]:
    return {name: targets - {root} for name, targets in graph.items() if name != root}


def _graph_report(graph: dict[str, set[str]], modules: dict[str, Module], root: str, floors) -> dict:
    found = cycles(_rootless(graph, root))
    upward = upward_arrows(graph, floors)
    return {
        "cycles": [[_short(m) for m in c] for c in found],
        "cycles_across_folders": sum(len({folder_of(modules[m]) for m in c}) > 1 for c in found),
        "upward": [f"{_short(a)} -> {_short(b)}" for a, b in upward],
        "upward_folder_pairs": sorted({f"{folder_of(modules[a])} -> {folder_of(modules[b])}" for a, b in upward}),
    }


def measure(src: Path, floors: dict[str, int] = FLOORS) -> dict:
    """All counts and lists for the package at ``src``, JSON-ready, paths relative to it."""
    modules = load_package(src)
    shape = scan(modules)
    structural = import_graph(modules, with_local=True)
    rootless = _rootless(structural, src.name)
    at_import = import_time_graph(modules)
    for item in shape.local_imports:
        importer, targets = item.pop("importer"), item.pop("targets")
        item["own_module"] = bool(targets)
        item["closes_cycle"] = any(reaches(at_import, m, importer) for t in targets
                                   for m in entered(importer, t, modules))
        item["on_cycle"] = importer in rootless and any(t in rootless and reaches(rootless, t, importer)
                                                        for t in targets)
        item["upward"] = any(is_upward(importer, t, floors) for t in targets)
    kinds = [item["kind"] for item in shape.local_imports]
    habit = [item for item in shape.local_imports if item["kind"] == "habit"]
    writes = shape.state_writes
    return {
        "package": src.name,
        "modules": len(modules),
        "lines": sum(m.line_count for m in modules.values()),
        "floors": floors,
        "unplaced_modules": sorted(_short(n) for n in modules if floor_of(n, floors) is None),
        "long_functions": shape.long_functions, "long_functions_allowed": shape.long_allowed,
        "many_parameters": shape.many_parameters,
        "local_imports": shape.local_imports,
        "local_imports_of_own_modules": sum(item["own_module"] for item in shape.local_imports),
        "local_import_kinds": {k: kinds.count(k) for k in ("cycle", "optional", "lazy", "optional dependency", "habit")},
        "habit_own_modules": sum(item["own_module"] for item in habit),
        "habit_closing_cycle": sum(item["closes_cycle"] for item in habit),
        "habit_on_cycle": sum(item["on_cycle"] for item in habit),
        "habit_upward": sum(item["upward"] for item in habit),
        "cycle_comments_closing_no_cycle": sum(item["kind"] == "cycle" and not item["closes_cycle"]
                                               for item in shape.local_imports),
        "graph_module_level": _graph_report(import_graph(modules, with_local=False), modules, src.name, floors),
        "graph_with_local": _graph_report(structural, modules, src.name, floors),
        "state_writes": writes,
        "state_writes_to_counters": sum(item["counter"] for item in writes),
        "state_writing_modules": len({item["where"].split(":")[0] for item in writes}),
        "probes": shape.probes,
        "getattr_hasattr_calls": shape.getattr_calls,
    }


def summary_lines(result: dict) -> list[tuple[str, int, str]]:
    """(what, count, note) for each line of the table."""
    kinds = result["local_import_kinds"]
    lines = [
        (f"functions over {LONG_FUNCTION} lines", len(result["long_functions"]),
         f"+{len(result['long_functions_allowed'])} allowed (cli parser, schema tables)"),
        (f"functions with more than {MANY_PARAMETERS} parameters", len(result["many_parameters"]), ""),
        ("imports inside functions outside cli.py", len(result["local_imports"]),
         f"{result['local_imports_of_own_modules']} of the package's own modules"),
        ("  with a 'cycle' comment", kinds["cycle"], ""),
        ("  with an 'optional' comment", kinds["optional"], ""),
        ("  with a 'lazy:' comment (loaded only where used)", kinds["lazy"], ""),
        ("  of an optional dependency, no comment", kinds["optional dependency"], ""),
        ("  habit (no reason given)", kinds["habit"], ""),
        ("    of which name the package's own modules", result["habit_own_modules"], ""),
        ("    of which, hoisted alone, would close a cycle", result["habit_closing_cycle"], ""),
        ("    of which sit on a cycle (local imports too)", result["habit_on_cycle"], ""),
        ("    of which point up a floor", result["habit_upward"], ""),
        ("  'cycle' comments where hoisting closes none", result["cycle_comments_closing_no_cycle"], ""),
    ]
    for key, label in (("graph_module_level", "module-level imports"), ("graph_with_local", "local imports too")):
        graph = result[key]
        lines += [(f"import cycles, {label}", len(graph["cycles"]), f"{graph['cycles_across_folders']} across folders"),
                  (f"upward arrows, {label}", len(graph["upward"]),
                   f"{len(graph['upward_folder_pairs'])} pairs of folders")]
    return lines + [
        ("modules on no floor", len(result["unplaced_modules"]), ""),
        (f"writes to the model's state outside {STATE_OWNER}", len(result["state_writes"]),
         f"from {result['state_writing_modules']} modules; {result['state_writes_to_counters']} to counters"),
        ("getattr/hasattr probes on the model", len(result["probes"]),
         f"of {result['getattr_hasattr_calls']} getattr/hasattr calls in {', '.join(PROBED_FOLDERS)}"),
    ]


def render(result: dict, listing: bool) -> str:
    commit = result.get("commit") or "no git commit"
    if result.get("uncommitted_changes"):
        commit += " + uncommitted changes"
    out = [f"code shape of {result['package']} ({commit}): {result['modules']} modules, {result['lines']} lines"]
    out += [f"{label:50} {count:5}  {note}".rstrip() for label, count, note in summary_lines(result)]
    if not listing:
        return "\n".join(out)

    def section(title, items):
        out.append(f"\n{title} ({len(items)})")
        out.extend(f"  {item}" for item in items)

    def marks(item):
        flags = [item["kind"]] + [name for name in ("closes_cycle", "on_cycle", "upward") if item[name]]
        return ", ".join(flags).replace("_", " ")

    section("long functions", [f"{i['where']} {i['function']} {i['lines']}" for i in result["long_functions"]])
    section("long, allowed", [f"{i['where']} {i['function']} {i['lines']}" for i in result["long_functions_allowed"]])
    section("many parameters", [f"{i['where']} {i['function']} {i['parameters']}" for i in result["many_parameters"]])
    section("function-local imports", [f"{i['where']} [{marks(i)}] {i['import']}" for i in result["local_imports"]])
    for key in ("graph_module_level", "graph_with_local"):
        section(f"cycles, {key}", [" <-> ".join(c) for c in result[key]["cycles"]])
        section(f"upward arrows, {key}", result[key]["upward"])
    section("modules on no floor", result["unplaced_modules"])
    section("state writes", [f"{i['where']} {i['write']}" for i in result["state_writes"]])
    section("probes", [f"{i['where']} {i['probe']}" for i in result["probes"]])
    return "\n".join(out)


def to_json(result: dict) -> str:
    """The result as JSON with one line per count and per listed item, so that two runs diff well."""
    lines = []
    for key, value in result.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            items = ",\n  ".join(json.dumps(item) for item in value)
            lines.append(f" {json.dumps(key)}: [\n  {items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def commit_of(src: Path) -> dict:
    """The checkout's short commit and whether the package differs from it (None outside git)."""
    def git(*args):
        try:
            done = subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True)
        except OSError:  # no git here
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    head = git("rev-parse", "--short", "HEAD")
    changes = git("status", "--porcelain", "--", ".") if head else None
    return {"commit": head, "uncommitted_changes": None if head is None else bool(changes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", type=Path, default=Path(__file__).resolve().parents[1] / "src" / "dl4py")
    parser.add_argument("--json", type=Path, help="write every count and list to this file")
    parser.add_argument("--list", action="store_true", help="list the items behind each count")
    args = parser.parse_args(argv)
    measured = measure(args.src)
    counts = {label.strip(): count for label, count, _ in summary_lines(measured)}
    result = {**commit_of(args.src), "counts": counts, **measured}
    print(render(result, args.list))
    if args.json:
        try:
            args.json.write_text(to_json(result), encoding="utf-8")
        except OSError as exc:
            raise SystemExit(f"code_shape: --json {args.json}: cannot write it: {exc.strerror}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
