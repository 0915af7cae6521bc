"""DeepSpeed's native ops the engine can use, loaded once per process.

DeepSpeed builds its ops with a C++ compiler the first time they are loaded, which takes
minutes; ``make setup`` (through ``main(['--build'])``) does it ahead of time.
Each op is optional: when one cannot build, the engine uses its pure-PyTorch path.

Builds go to ``<venv>/torch_extensions`` unless ``TORCH_EXTENSIONS_DIR`` is set, so two
checkouts never rebuild over each other. torch guards a build with a ``lock`` file and waits
for it forever; a build killed half-way leaves the file behind. So while a lock exists the
engine does not wait: it uses the fallback and says which file to remove.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import logging
import os
import sys
import time
import warnings

log = logging.getLogger(__name__)


STALE_LOCK_S = 1800  # no build of these ops takes half an hour; an older lock is left over


def extensions_dir() -> str:
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


extensions_dir()  # before anything loads an op, DeepSpeed's own (shm comm) included


def _build_lock(op: str) -> str | None:
    locks = glob.glob(os.path.join(extensions_dir(), "*", op, "lock")) + glob.glob(os.path.join(extensions_dir(), op, "lock"))
    return locks[0] if locks else None


def _no_build_running(op: str) -> bool:
    lock = _build_lock(op)
    if lock:
        warnings.warn(f"DeepSpeed's {op} op is being built by another process, or a build was interrupted "
                      f"({lock}); using the fallback for now. If no build is running, remove that file.", stacklevel=3)
    return lock is None


@functools.lru_cache(maxsize=None)
def import_deepspeed():
    """Import DeepSpeed with its log lines on stderr, so that stdout stays clean for ``--json``.

    DeepSpeed's logger writes to stdout; its handler is moved, not silenced.
    """
    import logging

    with contextlib.redirect_stdout(sys.stderr):  # its handler is created, and logs, on import
        import deepspeed

    for h in logging.getLogger("DeepSpeed").handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)
    return deepspeed


def _load_op(op: str, make_builder):
    """Load (building if needed) one DeepSpeed op; None when it cannot build or a build is under way."""
    if not _no_build_running(op):
        return None
    try:
        import_deepspeed()
        # The build prints compiler progress on stdout; keep it off our users' output.
        with contextlib.redirect_stdout(sys.stderr):
            builder = make_builder()
            if builder is None or not builder.is_compatible(verbose=False):
                return None
            return builder.load(verbose=False)
    except Exception as e:  # a failed build is an expected outcome here, not a crash
        log.info("DeepSpeed %s unavailable: %s", op, e)
        return None


def _accelerator_builder(name: str):
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(name)


@functools.lru_cache(maxsize=None)
def load_async_io():
    """DeepSpeed's ``async_io`` op module, or None when it cannot build (no libaio-dev).

    Built with the accelerator's builder, as ZeRO-Infinity does: the same flags, so one build
    serves both and neither rebuilds over the other.
    """
    return _load_op("async_io", lambda: _accelerator_builder("AsyncIOBuilder"))


@functools.lru_cache(maxsize=None)
def load_cpu_adam():
    """DeepSpeed's ``cpu_adam`` op module (the one DeepSpeedCPUAdam loads), or None."""
    def make():
        from deepspeed.ops.op_builder import CPUAdamBuilder

        return CPUAdamBuilder()

    return _load_op("cpu_adam", make)


def load_shm_comm():
    """DeepSpeed's shared-memory all-reduce for the CPU accelerator (built by DeepSpeed on first
    use; built here ahead of time). Not needed with CUDA."""
    import torch

    if torch.cuda.is_available():
        return "not needed with CUDA"
    return _load_op("deepspeed_shm_comm", lambda: _accelerator_builder("ShareMemCommBuilder"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.native_ops", description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="build (or find already built) the optional ops")
    args = ap.parse_args(argv)
    if not args.build:
        ap.print_help()
        return 0
    for name, loader in (("async_io", load_async_io), ("cpu_adam", load_cpu_adam), ("deepspeed_shm_comm", load_shm_comm)):
        lock = _build_lock(name)
        if lock and time.time() - os.stat(lock).st_mtime > STALE_LOCK_S:
            print(f"native op {name}: removing a build lock left by an interrupted build ({lock})")
            os.unlink(lock)
        print(f"native op {name}: {'ready' if loader() is not None else 'unavailable (fallback in use)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
