"""Per-process swap directories: creation, ownership, and clean-up after crashes.

Layout under each storage path::

    <path>/offloadctl-swap/rank<N>-<host>-pid<pid>-<token>/owner.json   who owns the directory
    <path>/offloadctl-swap/rank<N>-<host>-pid<pid>-<token>/*.swp         one file per subgroup

A directory is removed on ``close()`` and at interpreter exit. A crash (SIGKILL, power loss)
leaves it behind; the next engine on the same host that uses the path removes every
directory whose owner process is gone. Directories of other hosts (a shared file system)
are left alone.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time

SWAP_SUBDIR = "offloadctl-swap"
OWNER_FILE = "owner.json"


def _process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist.

    Compared with the owner record, so that a recycled pid does not keep a stale directory.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def make_swap_dir(path: str, rank: int = 0) -> str:
    """Create and claim this process's swap directory under ``path``."""
    root = os.path.join(path, SWAP_SUBDIR)
    os.makedirs(root, exist_ok=True)
    host = socket.gethostname()
    d = os.path.join(root, f"rank{rank}-{host}-pid{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(d, 0o700)
    owner = {"host": host, "pid": os.getpid(), "start_ticks": _process_start_ticks(os.getpid()),
             "created_unix_s": time.time()}
    tmp = os.path.join(d, OWNER_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(owner, f)
    os.replace(tmp, os.path.join(d, OWNER_FILE))
    return d


def remove_stale_swap_dirs(path: str) -> list[str]:
    """Remove swap directories under ``path`` left by dead processes of this host; return them."""
    root = os.path.join(path, SWAP_SUBDIR)
    removed: list[str] = []
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return removed
    host = socket.gethostname()
    for name in entries:
        d = os.path.join(root, name)
        try:
            with open(os.path.join(d, OWNER_FILE)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            # No readable owner record: a directory still being created, or not ours. Only
            # remove it once it is old enough that no creator can still be writing it.
            if f"-{host}-pid" in name and _age_s(d) > 3600:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
            continue
        if owner.get("host") != host:
            continue
        pid = owner.get("pid")
        ticks = owner.get("start_ticks")
        alive = isinstance(pid, int) and ticks is not None and _process_start_ticks(pid) == ticks
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def remove_swap_dir(d: str) -> None:
    shutil.rmtree(d, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(d))  # the shared offloadctl-swap/ folder, once empty
    except OSError:
        pass


def _age_s(d: str) -> float:
    try:
        return time.time() - os.stat(d).st_mtime
    except OSError:
        return 0.0
