"""DeepSpeed's native ops the engine can use, loaded once per process.

DeepSpeed builds its ops with a C++ compiler the first time they are loaded, which takes
minutes; ``python -m engine.native_ops --build`` (run by ``make setup``) does it ahead of time.
Each op is optional: when one cannot build, the engine uses its pure-PyTorch path.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def load_async_io():
    """DeepSpeed's ``async_io`` op module, or None when it cannot build (no libaio-dev)."""
    try:
        # DeepSpeed prints accelerator notices on import; they are noise for our users.
        with contextlib.redirect_stdout(io.StringIO()):
            from deepspeed.ops.op_builder import AsyncIOBuilder

            builder = AsyncIOBuilder()
            if not builder.is_compatible(verbose=False):
                return None
            return builder.load(verbose=False)
    except Exception as e:  # a failed build is an expected outcome here, not a crash
        log.info("DeepSpeed async_io unavailable: %s", e)
        return None


@functools.lru_cache(maxsize=None)
def load_cpu_adam():
    """DeepSpeed's ``cpu_adam`` op module, or None when it cannot build."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from deepspeed.ops.op_builder import CPUAdamBuilder

            return CPUAdamBuilder().load(verbose=False)
    except Exception as e:
        log.info("DeepSpeed cpu_adam unavailable: %s", e)
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.native_ops", description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="build (or find already built) the optional ops")
    args = ap.parse_args(argv)
    if not args.build:
        ap.print_help()
        return 0
    for name, loader in (("async_io", load_async_io), ("cpu_adam", load_cpu_adam)):
        print(f"native op {name}: {'ready' if loader() is not None else 'unavailable (fallback in use)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
