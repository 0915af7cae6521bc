"""Whether a directory can hold swap files, checked without torch.

``offloadctl train`` checks every ``--nvme``/``--remote`` path before it launches anything, so that
a wrong path is one line at once, not an error from each rank; that process never imports torch
(it would add seconds to every launch), so the O_DIRECT probe writes from an ``mmap`` page,
which is aligned as O_DIRECT needs.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading

from engine.errors import StoragePathError
from engine.layout import ALIGN_BYTES
from engine.storage.swapdir import check_swap_root


def check_usable(path: str) -> None:
    """Raise :class:`StoragePathError` unless ``path`` is a writable directory that supports O_DIRECT,
    where this user's swap directory cannot be another user's (:func:`check_swap_root`)."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StoragePathError(f"storage path {path} is a symbolic link loop: give a real directory") from None
    if not os.path.exists(path):
        raise StoragePathError(f"storage path {path} does not exist: create it (mkdir -p {path}) or fix the path")
    if not os.path.isdir(path):
        raise StoragePathError(f"storage path {path} is not a directory: give a directory for swap files")
    check_swap_root(path)
    probe = os.path.join(path, f".offloadctl-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except PermissionError:
        raise StoragePathError(
            f"storage path {path} is not writable by this user: fix its permissions or choose another path"
        ) from None
    except OSError as e:
        raise StoragePathError(f"storage path {path} cannot hold files ({e.strerror}): choose another path") from None
    os.close(fd)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
        try:
            with mmap.mmap(-1, ALIGN_BYTES) as page:  # anonymous: page-aligned and zeroed
                view = memoryview(page)
                try:
                    os.pwritev(fd, [view], 0)
                    os.preadv(fd, [view], 0)
                finally:
                    view.release()
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoragePathError(
                f"storage path {path} is full ({e.strerror}): free space there, or give another path"
            ) from None
        raise StoragePathError(
            f"storage path {path} does not support O_DIRECT ({e.strerror}), which offloading needs to bypass "
            f"the page cache: use a path on ext4, xfs or a parallel file system, not ramfs or overlayfs"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
