"""The ``offloadctl`` command: parses arguments, runs one subcommand, prints.

All logic lives in the library (``engine``, ``tuner``); each subcommand is one module under
``offloadctl/commands`` with ``add_arguments(parser)`` and ``run(args) -> int``. A user error
(:class:`engine.OffloadError`) is printed as one line naming the fault and the fix, with exit
status 2 and no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from offloadctl import __version__

COMMAND_NAMES = ("info", "train", "profile", "plan", "tuner", "tune", "report")
COMMANDS = {name: importlib.import_module(f"{__package__}.commands.{name}") for name in COMMAND_NAMES}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="offloadctl", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"offloadctl {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in COMMANDS.items():
        p = sub.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    from engine.errors import OffloadError

    from integrations.run_output import quiet_deepspeed_logger

    quiet_deepspeed_logger()  # DeepSpeed's import-time lines (the accelerator it picked) are not for this terminal
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 0
    try:
        return COMMANDS[args.command].run(args)
    except OffloadError as e:
        print(f"offloadctl: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("offloadctl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
