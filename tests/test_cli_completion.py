"""``dl4py --version`` and ``dl4py completion bash|zsh``: the completion script, sourced in a real
bash, completes the commands, a command's flags and a flag's choices from the parser itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dl4py.cli import _parser, main
from dl4py.completion import completion_script
from dl4py.version import __version__

bash = shutil.which("bash")
SRC = Path(__file__).resolve().parents[1] / "src"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"dl4py {__version__}\n"


def _complete(script: str, words: list[str]) -> list[str]:
    """What bash offers for the last of ``words`` (the command line typed so far)."""
    line = " ".join(f"'{w}'" for w in words)
    program = (f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _dl4py_complete; "
               'printf "%s\\n" "${COMPREPLY[@]}"')
    done = subprocess.run([bash, "-c", program], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return sorted(filter(None, done.stdout.splitlines()))


@pytest.mark.skipif(bash is None, reason="needs bash")
def test_bash_completes_commands_flags_and_choices(tmp_path):
    script = completion_script(_parser(), "bash")
    assert _complete(script, ["dl4py", "tr"]) == ["train"]
    assert "import-dl4j" in _complete(script, ["dl4py", ""]) and "completion" in _complete(script, ["dl4py", ""])
    assert _complete(script, ["dl4py", "train", "--prec"]) == ["--precision"]
    assert _complete(script, ["dl4py", "serve", "--inference-mode", ""]) == ["batched", "inplace", "sequential"]
    assert _complete(script, ["dl4py", "completion", ""]) == ["bash", "zsh"]
    (tmp_path / "lenet.yaml").write_text("")
    assert _complete(script, ["dl4py", "train", str(tmp_path / "len")]) == [str(tmp_path / "lenet.yaml")]


def test_the_command_prints_a_script_for_each_shell(capsys):
    assert main(["completion", "bash"]) == 0
    assert capsys.readouterr().out == completion_script(_parser(), "bash")
    assert main(["completion", "zsh"]) == 0
    zsh = capsys.readouterr().out
    assert zsh.startswith("autoload -U +X bashcompinit && bashcompinit\n") and "complete -o filenames" in zsh


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["completion", "bash"], ["schema", "--help"]])
def test_the_command_starts_without_importing_torch(argv):
    """PyTorch is most of the command's start-up (about 3 s of 3.2 here before): ``import dl4py`` loads
    names when they are used, and these commands use none that need it (benchmarks/cli_startup.py
    times them)."""
    program = ("import sys, contextlib, io\nfrom dl4py.cli import main\n"
               "with contextlib.redirect_stdout(io.StringIO()):\n"
               f"    try: main({argv!r})\n    except SystemExit: pass\n"
               "import dl4py\nassert dl4py.__version__\n"
               "print(sorted(m for m in ('torch', 'numpy', 'yaml') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_public_name_loads_when_asked_for():
    import dl4py

    for name in dl4py.__all__:
        assert getattr(dl4py, name) is not None, name
    assert dl4py.dl4j.save_dl4j is not None  # a subpackage on first use too
    with pytest.raises(AttributeError, match="module 'dl4py' has no attribute 'nothing_here'"):
        dl4py.nothing_here
