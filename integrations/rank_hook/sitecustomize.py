"""Every interpreter of a launch that ``offloadctl train`` runs as given (torchrun, accelerate
launch, srun, mpirun, ...) starts here: this directory is first on its PYTHONPATH.

It runs the ``sitecustomize`` it shadows (a venv's or the system's), then hands over to
``integrations.rank_entry.arm``, which does nothing unless this interpreter is a rank of the
run (not a launcher, not a process a rank starts): then it installs the engine and runs the
program the interpreter was given, exactly as ``integrations.bootstrap`` does under DeepSpeed's
launcher. Kept small: it runs in every Python process of the launch.
"""

import os
import sys


def _run_shadowed() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_shadowed()
if os.environ.get("OFFLOADCTL_RANK_SETTINGS"):
    from integrations import rank_entry

    rank_entry.arm()
