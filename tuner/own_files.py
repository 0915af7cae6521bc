"""The tuner daemon's files (socket, log, pidfile, history database) only where no one else can
put a link first.

In a directory others may write (a shared scratch directory, ``/tmp``), another user can create
``t.sock.log`` or ``t.db`` before the daemon does, as a symbolic link to a file of the victim's: the
daemon then appends its log to that file, or turns it into a SQLite database. SQLite's own files
beside the database (``-wal``, ``-shm``, ``-journal``) are opened by name and cannot be opened
without following links, so a directory others may write is refused outright, and each file the
daemon opens itself is opened without following a link and checked to be the user's own.
"""

from __future__ import annotations

import errno
import os
import stat

from engine.errors import ConfigError


def writable_by_others(st: os.stat_result, *, own_group_ok: bool = False) -> bool:
    """Whether users other than this one may create names in the directory ``st`` describes:
    writable by all, or by its group (the rule by which a client trusts a daemon's socket,
    ``tuner.protocol.check_daemon_socket``); ``own_group_ok``: not by this user's own group
    (a user's private group, which umask 002 leaves writable)."""
    if st.st_mode & stat.S_IWOTH:
        return True
    return bool(st.st_mode & stat.S_IWGRP) and not (own_group_ok and st.st_gid == os.getegid())


def shared_dir_problem(path: str, *, own_group_ok: bool = False) -> str | None:
    """Why the directory ``path`` cannot hold the daemon's files, or None: writable by other
    users (:func:`writable_by_others`), or held in a directory that lets others rename it away
    (writable by them, and not sticky)."""
    st = os.stat(path)
    if writable_by_others(st, own_group_ok=own_group_ok):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    parent = os.path.dirname(os.path.abspath(path))
    up = os.stat(parent)
    if writable_by_others(up, own_group_ok=True) and not up.st_mode & stat.S_ISVTX:
        return f"{path} is in {parent}, which other users may write (mode {stat.S_IMODE(up.st_mode):04o})"
    return None


def foreign_file_problem(path: str) -> str | None:
    """Why the existing name ``path`` cannot be the daemon's file, or None (also when there is none):
    a symbolic link, not a regular file, another user's, or a hard link of another file."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # none there (or a file in the way: said where it is opened)
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to you"
    if st.st_nlink > 1:
        return f"{path} has {st.st_nlink} hard links"
    return None


def open_own(path: str, flags: int, what: str, fix: str) -> int:
    """``os.open(path, flags | O_NOFOLLOW, 0o600)``, refused (ConfigError: ``what`` PATH ..., ``fix``)
    where ``path`` is a link or another user's file (:func:`foreign_file_problem`)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise ConfigError(f"{what} {path} is a symbolic link, which someone else may have put there: {fix}") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink > 1:
        os.close(fd)
        problem = foreign_file_problem(path) or f"{path} is not your own regular file"
        raise ConfigError(f"{what} {problem}, which someone else may have put there: {fix}")
    return fd
