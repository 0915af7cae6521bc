"""Blocking O_DIRECT transfers between an aligned host buffer and a file.

Two backends with one interface. Each call moves one chunk and blocks its thread with the
GIL released; :mod:`engine.storage.paths` runs many of them in parallel on a thread pool.

- ``aio``: DeepSpeed's ``async_io`` op (libaio, the DeepNVMe path of ZeRO-Infinity) for
  reads. One handle per I/O thread, since a handle's ``wait`` covers all of its requests.
  Writes go through ``pwritev`` even here: the op ignores each request's completion status
  (``io_event.res``, DeepSpeed 0.19), so a failed write (ENOSPC, EFBIG, EIO) would pass
  silently and lose state. A failed read is still caught, by the swap file's checksums.
- ``posix``: ``os.preadv``/``os.pwritev`` on a file opened with O_DIRECT. Always available.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import torch

from engine.errors import ConfigError
from engine.storage.native_ops import load_async_io


class ShortFileError(OSError):
    """The file ends before the requested range: it was truncated, so its state is gone."""


class PosixDirectIO:
    name = "posix"

    def pread(self, fd: int, path: str, buf: torch.Tensor, offset: int) -> None:
        view = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy: no __buffer__ in its stubs before 3.12
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise ShortFileError(errno.EIO, f"file ends at offset {offset + done}", path)
            done += n

    def pwrite(self, fd: int, path: str, buf: torch.Tensor, offset: int) -> None:
        view = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy: no __buffer__ in its stubs before 3.12
        done = 0
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], offset + done)


class DeepSpeedAIO(PosixDirectIO):
    """Reads through DeepSpeed's op; writes are :class:`PosixDirectIO`'s (see the module docstring:
    failed aio writes go unreported)."""

    name = "aio"

    def __init__(self, *, block_size: int = 1 << 20, queue_depth: int = 32) -> None:
        op = load_async_io()
        if op is None:
            raise ConfigError(
                "io_backend='aio' needs DeepSpeed's async_io op, which did not build here "
                "(install libaio-dev, then run `make setup`), or use io_backend='posix'"
            )
        self._op, self._block_size, self._queue_depth = op, block_size, queue_depth
        self._local = threading.local()

    def _handle(self) -> Any:  # the op's aio_handle (DeepSpeed's, untyped)
        h = getattr(self._local, "handle", None)
        if h is None:
            # intra_op_parallelism=1: parallelism comes from our I/O threads, one request each.
            h = self._local.handle = self._op.aio_handle(self._block_size, self._queue_depth, False, True, 1)
        return h

    def pread(self, fd: int, path: str, buf: torch.Tensor, offset: int) -> None:
        # The op aborts the process on a short file; a truncated swap file must be an error.
        if os.fstat(fd).st_size < offset + buf.numel():
            raise ShortFileError(errno.EIO, f"file is shorter than {offset + buf.numel()} bytes", path)
        # The op opens by name: this descriptor's file through /proc, so that a swap directory
        # deleted or renamed mid-run still reads from the file this rank made, never from a name.
        if self._handle().sync_pread(buf, f"/proc/self/fd/{fd}", offset) < 0:
            raise OSError(errno.EIO, f"async_io read of {buf.numel()} bytes at offset {offset} failed", path)


def open_backend(name: str) -> PosixDirectIO | DeepSpeedAIO:
    """The backend for ``name``: 'aio', 'posix', or 'auto' (aio when it loads)."""
    if name == "posix":
        return PosixDirectIO()
    if name == "aio" or load_async_io() is not None:
        return DeepSpeedAIO()
    return PosixDirectIO()
