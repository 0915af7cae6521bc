"""Show where a run's time, memory and bandwidth went, iteration by iteration.

RUN_DIR is the --run-dir of an `offloadctl train` run (offloadctl's engine or
--engine stock). It prints how fast the run went, the bottleneck in one line,
and a table; the page (default RUN_DIR/report.html) adds the plots. Several
runs are shown side by side, each against the first. docs/report.md says how
to read each plot.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (offloadctl train --run-dir)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the self-contained HTML report here")
    p.add_argument("--png", metavar="DIR", help="write one PNG per section into DIR")
    p.add_argument("--json", action="store_true", help="print the numbers behind every plot as JSON (no summary)")
    p.add_argument(
        "--iteration", type=int, metavar="N", help="the iteration of the timeline (0-based; default: the median one of each run)"
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="the rank to report (default: the lowest recorded in the run directory)",
    )
    p.add_argument(
        "--label",
        action="append",
        metavar="NAME",
        help="a run's name in the report, in RUN_DIR order (repeatable; default: the directory's name and engine)",
    )


def run(args: argparse.Namespace) -> int:
    from engine.errors import ConfigError
    from report import build_report
    from report.render import html_page, print_summary, to_json, write_pngs

    output = args.output
    if output and os.path.isdir(output):
        raise ConfigError(f"--output {output} is a directory: give a file name, e.g. {os.path.join(output, 'report.html')}")
    if args.png and os.path.lexists(args.png) and not os.path.isdir(args.png):
        raise ConfigError(f"--png {args.png} is a file: give a directory for the PNGs (it is created if missing)")
    analysis, pngs = build_report(args.run_dirs, iteration=args.iteration, rank=args.rank, labels=args.label)
    if not (output or args.png or args.json):
        output = os.path.join(args.run_dirs[0], "report.html")
    files: dict = {}
    flag = "--output" if args.output else "the report"
    try:
        if args.png:
            flag = "--png"
            files["png"] = write_pngs(pngs, args.png)
        if output:
            flag = "--output" if args.output else "the report"
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
            with open(output, "w") as f:
                f.write(html_page(analysis, pngs))
            files["html"] = os.path.abspath(output)
    except OSError as e:
        where = e.filename or output or args.png
        raise ConfigError(
            f"{flag}: cannot write {where} ({e.strerror or e}): give a writable place"
            f"{' with --output FILE' if flag == 'the report' else ''}"
        ) from None
    if args.json:
        print(to_json(analysis, files))
        return 0
    print_summary(analysis)
    if "html" in files:
        print(f"report: {files['html']}")
    if "png" in files:
        print(f"plots: {os.path.abspath(args.png)} ({', '.join(os.path.basename(p) for p in files['png'].values())})")
    return 0
