"""Train models whose optimizer state does not fit in GPU memory, with DeepSpeed ZeRO-3.

offloadctl runs an unmodified DeepSpeed ZeRO-3 script with its optimizer state spread over
GPU memory, host memory, local NVMe and remote file systems, and keeps the disks and the GPU
busy while it trains. Start with:

    offloadctl train --nvme /path/on/ssd script.py [script args]

then `offloadctl report RUN_DIR` for where the time went. `offloadctl COMMAND --help` tells
more about each command.
"""

# How the CLI is laid out: each subcommand is one module under offloadctl/commands with
# add_arguments(parser) and run(args) -> int. A user error (engine.errors.OffloadError) is
# printed as one line naming the fault and the fix, exit status 2, no traceback.
from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
import textwrap

from offloadctl import __version__

COMMAND_NAMES = ("info", "train", "profile", "plan", "tuner", "tune", "report", "completion")
COMMANDS = {name: importlib.import_module(f"{__package__}.commands.{name}") for name in COMMAND_NAMES}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, their prose paragraphs filled to the terminal: indented lines
    (commands, examples) are kept as they are; ``double backticks`` become `single` ones."""

    def _fill_text(self, text, width, indent):
        text = re.sub(r"``([^`]+)``", r"`\1`", text)
        out, prose = [], []

        def flush():
            if prose:
                out.append(
                    textwrap.fill(" ".join(prose), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)
                )
                prose.clear()

        for line in text.splitlines():
            if not line.strip() or line.startswith((" ", "\t")):
                flush()
                out.append(indent + line if line.strip() else "")
            elif re.match(r"^[a-z ]+:$", line) or re.match(r"^[-*] ", line):
                flush()
                prose.append(line) if line.startswith(("-", "*")) else out.append(indent + line)
            else:
                prose.append(line)
        flush()
        return "\n".join(out)


class Parser(argparse.ArgumentParser):
    """No abbreviated options: `--nvm` is not `--nvme`, it is a mistake to point out."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="offloadctl", description=__doc__)
    ap.add_argument("--version", action="version", version=f"offloadctl {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, mod in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=(mod.__doc__ or "").splitlines()[0].rstrip("."),
            description=mod.__doc__,
            **getattr(mod, "PARSER_OPTIONS", {}),
        )
        mod.add_arguments(p)
    return ap


def subparser(ap: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return ap


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for options ``parser`` does not take, with the nearest one it does."""
    known = [s for a in parser._actions for s in a.option_strings if a.help != argparse.SUPPRESS]
    flags = [e for e in extras if e.startswith("-")]
    msg = f"unrecognized arguments: {' '.join(extras)}"
    for flag in flags:
        near = difflib.get_close_matches(flag.split("=", 1)[0], known, n=1, cutoff=0.6)
        if near:
            msg += f" (did you mean {near[0]}?)"
            break
    return msg


def main(argv: list[str] | None = None) -> int:
    from engine.errors import OffloadError
    from integrations.ds_patches import quiet_deepspeed_logger

    quiet_deepspeed_logger()  # DeepSpeed's import-time lines (the accelerator it picked) are not for this terminal
    ap = build_parser()
    args, extras = ap.parse_known_args(argv)
    if extras:
        subparser(ap, args.command).error(unrecognized(extras, subparser(ap, args.command)))
    if not args.command:
        ap.print_help()
        return 0
    try:
        return COMMANDS[args.command].run(args)
    except OffloadError as e:
        from engine.text import printable

        print(f"offloadctl: {printable(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("offloadctl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `offloadctl ... --json | head`: the reader has all it wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + 13  # as a process killed by SIGPIPE, like any other filter in a pipe


if __name__ == "__main__":
    raise SystemExit(main())
