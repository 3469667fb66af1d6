"""Shell completion for the ``dl4py`` command, made from its argparse parser (so it never lists a
command or flag the parser does not have): ``dl4py completion bash`` prints a bash script,
``dl4py completion zsh`` the same for zsh through its ``bashcompinit``.

    dl4py completion bash > ~/.local/share/bash-completion/completions/dl4py
    echo 'eval "$(dl4py completion zsh)"' >> ~/.zshrc

Completed: the commands, each command's flags, a flag's fixed choices (``--backend cpu``), and
file names everywhere else (configs, run folders, models). No dependency: the parser is read
here and the script is plain bash.
"""

from __future__ import annotations

import argparse
import shlex

SHELLS = ("bash", "zsh")


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser``'s program for ``shell`` (bash or zsh)."""
    if shell not in SHELLS:
        raise ValueError(f"shell must be one of {', '.join(SHELLS)}, got {shell!r}")
    program = parser.prog
    commands = _subcommands(parser)
    function = "_" + program.replace("-", "_") + "_complete"
    lines = [
        f"# {program} completion ({shell}), made by `{program} completion {shell}`",
        f"{function}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
        "    if [ \"$COMP_CWORD\" -eq 1 ]; then",
        f"        COMPREPLY=($(compgen -W {_words(commands)} -- \"$cur\")); return",
        "    fi",
        '    case "${COMP_WORDS[1]}" in',
    ]
    for name, command in commands.items():
        flags, choices = _options(command)
        lines.append(f"        {shlex.quote(name)})")
        if choices:
            lines.append('            case "$prev" in')
            for flag, values in choices.items():
                lines.append(f"                {flag}) COMPREPLY=($(compgen -W {_words(values)} -- \"$cur\")); return;;")
            lines.append("            esac")
        positional = _positional_choices(command)
        lines += [
            '            if [[ "$cur" == -* ]]; then',
            f"                COMPREPLY=($(compgen -W {_words(flags)} -- \"$cur\")); return",
            "            fi",
        ]
        if positional:
            lines.append(f"            COMPREPLY=($(compgen -W {_words(positional)} -- \"$cur\")); return;;")
        else:
            lines.append('            COMPREPLY=($(compgen -f -- "$cur")); return;;')
    lines += ["    esac", "}"]
    prefix = ["autoload -U +X bashcompinit && bashcompinit"] if shell == "zsh" else []
    return "\n".join(prefix + lines + [f"complete -o filenames -F {function} {program}", ""])


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its sub-parsers here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(command: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]]]:
    """A command's flags, and the fixed choices of those that have some."""
    flags, choices = [], {}
    for action in command._actions:
        flags += [flag for flag in action.option_strings if flag.startswith("--") or len(action.option_strings) == 1]
        if action.option_strings and action.choices:
            for flag in action.option_strings:
                choices[flag] = [str(choice) for choice in action.choices]
    return sorted(flags), choices


def _positional_choices(command: argparse.ArgumentParser) -> list[str]:
    for action in command._actions:
        if not action.option_strings and action.choices:
            return [str(choice) for choice in action.choices]
    return []


def _words(words) -> str:
    return shlex.quote(" ".join(words))
