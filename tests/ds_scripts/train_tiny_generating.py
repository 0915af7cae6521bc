"""train_tiny.py as an RLHF loop runs it: ``--offload-gap-s`` seconds of generation between
``engine.offload_states()`` and ``engine.reload_states()`` (train_tiny's ``--offload-states-at``).
A wrapper, so that train_tiny.py, whose stock runs are kept golden by its contents, stays as it is.

    deepspeed train_tiny_generating.py --offload-gap-s 1 --offload-states-at 3 ...
"""

import os
import runpy
import sys
import time

at = sys.argv.index("--offload-gap-s")
gap_s = float(sys.argv[at + 1])
del sys.argv[at : at + 2]

from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

reload_states = DeepSpeedEngine.reload_states


def reload_after_generation(self, *args, **kwargs):
    time.sleep(gap_s)  # the generation, on the GPU the offload freed
    return reload_states(self, *args, **kwargs)


DeepSpeedEngine.reload_states = reload_after_generation
tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_tiny.py")
sys.argv[0] = tiny
runpy.run_path(tiny, run_name="__main__")
