"""Run, start, stop or query the tuner daemon.

    offloadctl tuner serve   # in the foreground (systemd, a terminal)
    offloadctl tuner start   # detached; pidfile and log next to the socket
    offloadctl tuner stop
    offloadctl tuner status  # exit status 3 when no daemon answers

Each takes --socket PATH; serve and start take --db PATH. The default socket
is $XDG_RUNTIME_DIR/offloadctl/tuner.sock (/run/offloadctl/tuner.sock for
root); the default history is $XDG_STATE_HOME/offloadctl/tuner.db.
`offloadctl train` starts a private daemon in RUN_DIR/tuner/ when none runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from engine.errors import ConfigError, OffloadError
from tuner.service import (
    default_db_path,
    default_socket_path,
    register_run,
    release_pid,
    start,
    status,
    stop,
    unregister_run,
    write_pid,
)

NOT_RUNNING = 3  # like `systemctl status` for an inactive unit


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="tuner_command", metavar="ACTION", required=True)
    for name, text in (
        ("serve", "run the daemon in the foreground"),
        ("start", "start a detached daemon"),
        ("stop", "stop the daemon"),
        ("status", "show whether a daemon runs and what it serves"),
    ):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument(
            "--socket",
            metavar="PATH",
            help="the daemon's Unix socket (default: $XDG_RUNTIME_DIR/"
            "offloadctl/tuner.sock; /run/offloadctl/tuner.sock for root)",
        )
        if name in ("serve", "start"):
            s.add_argument(
                "--db",
                metavar="PATH",
                help="history of earlier runs (default: $XDG_STATE_HOME/offloadctl/tuner.db); 'none' keeps none",
            )
        if name in ("start", "stop", "status"):
            s.add_argument("--json", action="store_true", help="print JSON")
        if name == "serve":
            s.add_argument("--pidfile", metavar="PATH", help="write the daemon's pid here (removed at exit)")
            s.add_argument(
                "--policy",
                metavar="MODULE:CALLABLE",
                help="a policy factory to use instead of the built-in policy (experiments, tests)",
            )
            s.add_argument("--no-sensors", action="store_true", help="do not sample disks and GPUs")
            s.add_argument(
                "--frame-timeout",
                type=float,
                default=10.0,
                metavar="S",
                help="a frame must arrive within S seconds of its first byte (default 10)",
            )
            s.add_argument(
                "--handshake-timeout",
                type=float,
                default=10.0,
                metavar="S",
                help="a new connection must say hello within S seconds (default 10)",
            )
            s.add_argument(
                "--margin",
                type=float,
                default=0.5,
                metavar="S",
                help="seconds of iterations between a decision and the iteration it applies at "
                "(at least 2 iterations; default 0.5)",
            )
            s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
            s.add_argument("--owner-pid", type=int, metavar="PID", help="stop when this process is gone (a run's private daemon)")
            s.add_argument("--idle-exit", type=float, metavar="S", help="stop after S seconds with no run")
            s.add_argument(
                "--run-dir", metavar="DIR", help="the run this daemon serves: listed for `offloadctl tune` while it runs"
            )
            s.add_argument("--run-id", metavar="RUN", help="with --run-dir: that run's id, listed with it")


def run(args: argparse.Namespace) -> int:
    return {"serve": _serve, "start": _start, "stop": _stop, "status": _status}[args.tuner_command](args)


def _serve(args: argparse.Namespace) -> int:
    from tuner.server import ServerConfig, serve

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        socket_path=os.path.abspath(args.socket or default_socket_path()),
        frame_timeout_s=args.frame_timeout,
        handshake_timeout_s=args.handshake_timeout,
        margin_s=args.margin,
        owner_pid=args.owner_pid,
        idle_exit_s=args.idle_exit,
    )
    history = _open_history(args.db or default_db_path())
    policy = _load_factory(args.policy) if args.policy else None

    entry = None

    def ready(server) -> None:
        nonlocal entry
        if args.run_dir:
            try:
                entry = register_run(config.socket_path, args.run_dir, run_id=args.run_id)
            except (OSError, OffloadError) as e:  # the run is served all the same; only `tune` will not list it
                logging.getLogger("offloadctl.tuner").warning("not listed among the live runs: %s", e)
        if args.pidfile:  # only once the socket is ours
            write_pid(args.pidfile)

    try:
        return serve(
            config, policy_factory=policy, sensors_factory=None if not args.no_sensors else False, history=history, ready=ready
        )
    finally:
        if entry is not None:
            unregister_run(entry)
        if args.pidfile:
            release_pid(args.pidfile)


def _open_history(db: str):
    if db == "none":
        return None
    from tuner.history import History

    return History(db)


def _load_factory(spec: str):
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr or "Policy")
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--policy {spec}: {e}: give MODULE:CALLABLE importable from PYTHONPATH") from None


def _start(args: argparse.Namespace) -> int:
    info = start(args.socket, db_path=args.db)
    info.pop("process", None)
    if info["already_running"]:
        return _said(args, info, "tuner daemon already running at {socket} (pid {pid})")
    return _said(args, info, "tuner daemon started at {socket} (pid {pid}, log {log})")


def _stop(args: argparse.Namespace) -> int:
    info = stop(args.socket)
    return _said(
        args, info, "tuner daemon at {socket} stopped (pid {pid})" if info["was_running"] else "no tuner daemon at {socket}"
    )


def _said(args: argparse.Namespace, info: dict, text: str) -> int:
    """``info`` as JSON with --json, else ``text`` filled from it."""
    print(json.dumps(info, indent=2) if args.json else text.format(**info))
    return 0


def _status(args: argparse.Namespace) -> int:
    info = status(args.socket)
    if args.json:
        print(json.dumps(info, indent=2))
    elif not info["running"]:
        why = f" ({info['reason']})" if info.get("reason") else ""
        print(
            f"offloadctl: no tuner daemon answers at {info['socket']}{why}: start one with `offloadctl tuner start`",
            file=sys.stderr,
        )
    else:
        print(
            f"tuner daemon at {info['socket']}: pid {info['pid']}, offloadctl {info['version']} (API "
            f"{info['api']}), up {info['uptime_s']:.0f} s, {info['connections']} connection(s)"
            + (", socket-activated" if info["socket_activated"] else "")
        )
        for r in info["runs"]:
            t = f"{r['iter_time_s']:.3f} s" if r["iter_time_s"] is not None else "-"
            print(
                f"  {r['run_id']}: {r['status']}, {r['connected']}/{r['ranks']} ranks, iteration {r['iteration']}, "
                f"iteration time {t}"
            )
    return 0 if info["running"] else NOT_RUNNING
