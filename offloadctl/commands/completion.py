"""Print a shell completion script for offloadctl: its commands and each command's options.

    eval "$(offloadctl completion bash)"    # in ~/.bashrc
    eval "$(offloadctl completion zsh)"     # in ~/.zshrc

Made from offloadctl's own parser, so it completes exactly the commands and options this
version has; after an option or a script, file names.
"""

from __future__ import annotations

import argparse
import shlex

SHELLS = ("bash", "zsh")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")


def words(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each command's options (shown in its --help), and '' -> the commands."""
    from offloadctl.cli import subparser

    out: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out[""] = sorted(action.choices)
    for command in out.get("", []):
        sub = subparser(parser, command)
        out[command] = sorted(s for a in sub._actions if a.help != argparse.SUPPRESS for s in a.option_strings)
    return out


def bash_script(parser: argparse.ArgumentParser) -> str:
    table = words(parser)
    cases = "\n".join(f"        {c}) opts={shlex.quote(' '.join(o))} ;;" for c, o in table.items() if c)
    return f"""# offloadctl completion (offloadctl completion bash)
_offloadctl() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} opts=""
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W {shlex.quote(" ".join(table[""]) + " --help --version")} -- "$cur"))
        return
    fi
    case "${{COMP_WORDS[1]}}" in
{cases}
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}}
complete -o default -F _offloadctl offloadctl
"""


def run(args: argparse.Namespace) -> int:
    from offloadctl.cli import build_parser

    script = bash_script(build_parser())
    if args.shell == "zsh":  # zsh runs bash's completion functions through bashcompinit
        script = "autoload -U +X compinit && compinit\nautoload -U +X bashcompinit && bashcompinit\n" + script
    print(script, end="")
    return 0
