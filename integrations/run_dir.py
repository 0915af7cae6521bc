"""A run's directory (``offloadctl train --run-dir``): one run at a time, private to its user.

- The default, ``./runs/<date>-<time>``, is a directory no earlier run made: a second
  launch in the same second gets ``-2``, and the name is taken with an exclusive ``mkdir``, so
  two launches at once never share one.
- :func:`claim` takes a run dir for a run: it refuses one that another live run holds (a lock
  on the directory, held until this process exits) and one that holds an earlier run's
  records (unless ``force``: then those records go first), in one line naming the fix; one
  whose earlier run ran no iteration (refused at its start) is taken again as it is.
- A run dir offloadctl makes is 0700 (the records hold the script's argv, which may hold a
  token), as is an empty one it is given; the log and records it writes there are 0600 whatever
  the dir's mode (:mod:`engine.record_files`), and a dir it leaves open to others (one holding
  other files, given with ``--force`` or not) is said in one line (:attr:`RunDir.note`).

Imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import stat
import time

from engine.errors import ConfigError

RUN_FILES = ("record-rank*.jsonl", "samples-rank*.jsonl", "telemetry-rank*.jsonl", "deepspeed.log", "tuner")
"""What a run leaves in its run dir (the recorder's, the engine's, the log, the private tuner's);
a directory holding any of them holds a run."""


class DefaultTaken(Exception):
    """The default run dir was made by another launch between choosing and taking it."""


def default_run_dir(base: str = "runs") -> str:
    """``base/<date>-<time>``, or ``-2``, ``-3``... after it where that exists (absolute)."""
    stamp = os.path.abspath(os.path.join(base, time.strftime("%Y%m%d-%H%M%S")))
    candidate, n = stamp, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{stamp}-{n}"
    return candidate


def earlier_run(run_dir: str) -> list[str]:
    """The names of an earlier run's files in ``run_dir`` (empty: it holds none)."""
    return sorted({os.path.basename(f) for pattern in RUN_FILES for f in glob.glob(os.path.join(glob.escape(run_dir), pattern))})


class RunDir:
    """A claimed run dir: the lock is held while this object lives (or until :meth:`release`)."""

    def __init__(self, path: str, fd: int | None, note: str | None = None) -> None:
        self.path, self._fd = path, fd
        self.note = note
        """One line for the user where the dir is open to others (its records are private all the same)."""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def claim(run_dir: str, *, flag: str, force: bool = False, default: bool = False) -> RunDir:
    """Take ``run_dir`` for this run (see the module's docstring). ``flag`` is how the user gave
    it (for the messages); ``default``: it is the default, taken with an exclusive mkdir
    (:class:`DefaultTaken` where another launch took it first). ConfigError in one line."""
    parent = os.path.dirname(run_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        if default:
            try:
                os.mkdir(run_dir, 0o700)
            except FileExistsError:
                raise DefaultTaken(run_dir) from None
        elif os.path.islink(run_dir) and not os.path.isdir(run_dir):
            os.stat(run_dir)  # a loop (ELOOP) or a link to nothing (ENOENT)
        elif not os.path.isdir(run_dir):
            os.mkdir(run_dir, 0o700)
        elif _owned_and_empty(run_dir):
            os.chmod(run_dir, 0o700)
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise ConfigError(f"{flag} {run_dir}: {_why(e)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            os.close(fd)
            raise ConfigError(
                f"{flag} {run_dir} is in use by a running `offloadctl train`: give another {flag}, or wait for that run to end"
            ) from None
        # A file system without flock (some network ones): no lock, the other checks stand.
    earlier = earlier_run(run_dir)
    if earlier and not force and ran_iterations(run_dir):
        os.close(fd)
        raise ConfigError(
            f"{flag} {run_dir} holds an earlier run ({', '.join(earlier[:4])}"
            f"{', ...' if len(earlier) > 4 else ''}): give another {flag}, or add --force to replace its "
            f"records"
        )
    for name in earlier:
        path = os.path.join(run_dir, name)
        try:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"{flag} {run_dir}: cannot remove the earlier run's {name} ({_why(e)})") from None
    return RunDir(run_dir, fd, _open_to_others(run_dir, fd, flag))


def recorded_iterations(run_dir: str) -> bool:
    """Whether a rank's record in ``run_dir`` holds an iteration (``offloadctl report`` has something to show)."""
    return _any_line(run_dir, "record-rank*.jsonl", '"type":"iteration"')


def ran_iterations(run_dir: str) -> bool:
    """Whether the run in ``run_dir`` ran an iteration (its record, or the engine's telemetry, has
    one). One that did not (a config the ranks refused, a port in use: the same command's retry
    takes its dir again) holds nothing to keep."""
    return recorded_iterations(run_dir) or _any_line(run_dir, "telemetry-rank*.jsonl", "")


def _any_line(run_dir: str, pattern: str, text: str) -> bool:
    for path in glob.glob(os.path.join(glob.escape(run_dir), pattern)):
        try:
            with open(path) as f:
                if any(text in line for line in f if line.strip()):
                    return True
        except OSError:
            continue
    return False


def _open_to_others(run_dir: str, fd: int, flag: str) -> str | None:
    """The note for a run dir others may read or enter (left so: it holds more than this run's)."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if not mode & 0o077:
        return None
    return (
        f"offloadctl: {flag} {run_dir} is open to other users (mode {mode:04o}): the run's records there are "
        f"created private (0600); chmod 700 {run_dir} to hide their names too"
    )


def in_use(run_dir: str) -> bool:
    """Whether a live ``offloadctl train`` holds ``run_dir`` (its lock, :func:`claim`)."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # drops the shared lock, if taken


def _owned_and_empty(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.getuid() and not os.listdir(path)
    except OSError:
        return False


def _why(e: OSError) -> str:
    return {
        errno.EROFS: "the file system is read-only: give a writable directory",
        errno.EACCES: "permission denied: give a directory you can write",
        errno.ELOOP: "a symbolic link loop: give a real directory",
        errno.ENOSPC: "the disk is full: free space, or give a directory on another disk",
        errno.ENOTDIR: "a part of the path is a file: give a directory",
        errno.EEXIST: "exists and is not a directory: give a directory",
        errno.ENOENT: "a symbolic link to nothing: give a real directory",
    }.get(e.errno or 0, e.strerror or str(e))
