"""A script that trains at its top level needs ``if __name__ == "__main__":``.

Spawned workers start by importing the main script again (that is how ``spawn`` gives them
its functions and classes). Code at the script's top level then runs in every worker,
and a ``fit`` there would start workers of its own; multiprocessing refuses that, and the
worker dies before it can say why. So the ParallelWrapper looks before it spawns: the
line of the main script that led to ``fit`` must lie inside a ``__name__`` guard.

    if __name__ == "__main__":
        ParallelWrapper(model, workers=2).fit(data)
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
from pathlib import Path

from dl4py.errors import ConfigError

ADVICE = ('wrap the training code of {script} in `if __name__ == "__main__":`, keeping imports, functions and '
          "classes above it (each worker process imports {script} again when it starts, and would run that code too)")


def check_main_guard() -> None:
    """Raise a ConfigError if ``fit`` was reached from the main script's top level outside
    ``if __name__ == "__main__":``, or while a spawned worker re-imports the script."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # We are a worker still importing the main script: the parent's check could not
        # read it (no source, e.g. a .pyc); say so here rather than multiprocessing's riddle.
        raise ConfigError("", "ParallelWrapper.fit was reached while a worker process was importing the main "
                              "script: " + ADVICE.format(script=_script_name()))
    main = sys.modules.get("__main__")
    if main is None or not _reimported_by_spawn(main):
        return
    line = _top_level_line(main)
    if line is None:  # called from a function the script calls under its guard, or not from it
        return
    guarded = _guarded_lines(main.__file__)
    if guarded is not None and not any(first <= line <= last for first, last in guarded):
        script = Path(main.__file__).name
        raise ConfigError(f"{script}, line {line}", "ParallelWrapper.fit is reached from the top level of the "
                                                    "script: " + ADVICE.format(script=script))


def _reimported_by_spawn(main) -> bool:
    """Whether spawned workers run the main module again, as multiprocessing decides it: not
    a package's ``__main__`` (``python -m dl4py``), nor IPython, nor a session without a
    file (an interactive prompt, ``python -c``, a notebook)."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:  # run with -m
        return not (name == "__main__" or name.endswith(".__main__"))
    path = getattr(main, "__file__", None)
    return path is not None and Path(path).stem != "ipython"


def _top_level_line(main) -> int | None:
    """The line of the main script's top level that is running now (it leads to this call)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__:
            return frame.f_lineno
        frame = frame.f_back
    return None


def _guarded_lines(path) -> list[tuple[int, int]] | None:
    """First and last line of the body of every ``if __name__ == "__main__":`` in the file;
    None when its source cannot be read (the check then stays silent)."""
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    return [(node.body[0].lineno, node.body[-1].end_lineno) for node in ast.walk(tree)
            if isinstance(node, ast.If) and _is_main_test(node.test)]


def _is_main_test(test) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    constants = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and constants == ["__main__"]


def _script_name() -> str:
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return Path(path).name if path else "the main script"
