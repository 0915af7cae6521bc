"""Per-process swap directories: creation, ownership, and clean-up after crashes.

Layout under each storage path::

    <path>/offloadctl-swap-<uid>/rank<N>-<host>-pid<pid>-<token>/owner.json   who owns the directory
    <path>/offloadctl-swap-<uid>/rank<N>-<host>-pid<pid>-<token>/*.swp         one file per subgroup

A directory is removed on ``close()`` and at interpreter exit. A crash (SIGKILL, power loss)
leaves it behind; the next engine on the same host that uses the path removes every
directory whose owner process is gone. Directories of other hosts (a shared file system)
are left alone.

Each user has a directory of their own under a path (``offloadctl-swap-<uid>``, mode 0700): a
storage path may be a cluster's world-writable ``/scratch``, where another user can make that
name first (writable by all, or a symbolic link to a directory of the victim's) and then move a
live run's swap files away or put files of their own in their place (a CRC is no proof of who
wrote a file). So the directory is refused unless it is a real directory of this user's that
no one else may write, and a path every user may write without the sticky bit (where anyone
may rename anyone's entries) is refused too.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import stat
import time

from engine.errors import StoragePathError

SWAP_SUBDIR = "offloadctl-swap"
"""The per-user directory's name, before ``-<uid>``."""
OWNER_FILE = "owner.json"


def user_swap_root(path: str) -> str:
    """This user's swap directory under storage path ``path`` (whether or not it exists)."""
    return os.path.join(path, f"{SWAP_SUBDIR}-{os.geteuid()}")


def check_swap_root(path: str) -> None:
    """Refuse, in one line naming the directory and the fix, a storage path where this user's
    swap directory could be another user's: the path writable by every user without the
    sticky bit, or ``user_swap_root(path)`` a symbolic link, not a directory, another user's,
    or writable by others. Fine when it does not exist yet."""
    try:
        st = os.stat(path)
    except OSError:
        return  # check_usable says what is wrong with the path itself
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise StoragePathError(
            f"storage path {path} is writable by every user without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):04o}), so another user could replace its swap files: "
            f"chmod +t {path}, or give a directory of your own"
        )
    root = user_swap_root(path)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        if os.path.islink(root):
            raise StoragePathError(
                f"swap directory {root} is a symbolic link, which another user may have planted: "
                f"remove it (rm {root}), or give another path"
            ) from None
        raise StoragePathError(
            f"swap directory {root} is not a directory of yours ({e.strerror}): remove it, or give another path"
        ) from None
    try:
        _check_root_fd(fd, root)
    finally:
        os.close(fd)


def _check_root_fd(fd: int, root: str) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise StoragePathError(
            f"swap directory {root} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): "
            f"another user made it; have it removed, or give another path"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StoragePathError(
            f"swap directory {root} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}), "
            f"who may have put files there: remove it (rm -r {root}), or give another path"
        )


def _open_swap_root(path: str) -> tuple[str, int]:
    """This user's swap directory under ``path``, made (0700) if missing and checked: (its path,
    a descriptor of it, opened without following a link, that the caller closes)."""
    check_swap_root(path)
    root = user_swap_root(path)
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StoragePathError(f"cannot make swap directory {root} ({e.strerror}): give another path") from None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        check_swap_root(path)  # replaced between the check and the open: say by what
        raise StoragePathError(f"swap directory {root} changed while it was opened: give another path") from None
    try:
        _check_root_fd(fd, root)
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # one of this user's, made by an older version: private now
    except BaseException:
        os.close(fd)
        raise
    return root, fd


def _process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist.

    Compared with the owner record, so that a recycled pid does not keep a stale directory.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return int(raw[raw.rindex(b")") + 2 :].split()[19])


def make_swap_dir(path: str, rank: int = 0) -> str:
    """Create and claim this process's swap directory under ``path`` (in this user's own; see
    the module docstring)."""
    host = socket.gethostname()
    name = f"rank{rank}-{host}-pid{os.getpid()}-{secrets.token_hex(4)}"
    for _ in range(5):
        root, root_fd = _open_swap_root(path)
        try:
            os.mkdir(name, 0o700, dir_fd=root_fd)
        except FileNotFoundError:
            continue  # another rank removed the empty root between our open and mkdir: make it again
        except OSError as e:
            raise StoragePathError(f"cannot make a swap directory in {root} ({e.strerror}): give another path") from None
        finally:
            os.close(root_fd)
        break
    else:
        raise StoragePathError(f"swap directory {user_swap_root(path)} keeps disappearing: give another path")
    d = os.path.join(root, name)
    owner = {"host": host, "pid": os.getpid(), "start_ticks": _process_start_ticks(os.getpid()), "created_unix_s": time.time()}
    tmp = os.path.join(d, OWNER_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)
    os.replace(tmp, os.path.join(d, OWNER_FILE))
    return d


def remove_stale_swap_dirs(path: str) -> list[str]:
    """Remove swap directories under ``path`` left by dead processes of this host; return them.
    Only in this user's own directory, checked first (a link planted there is never followed)."""
    check_swap_root(path)
    root = user_swap_root(path)
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
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(d))  # this user's offloadctl-swap-<uid>/ folder, once empty


def _age_s(d: str) -> float:
    try:
        return time.time() - os.stat(d).st_mtime
    except OSError:
        return 0.0
